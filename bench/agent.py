"""CPU and memory of the node agent at 1 Hz with 8 GPUs.

The agent runs in a process of its own, exactly as in production (sampling
thread, Telemetry stream, PodResources polling), except that NVML is a
stand-in with the pynvml function names whose every call burns
``--call-cost-us`` of CPU. The bench process hosts the Telemetry server and a
kubelet PodResources server on a unix socket, and reads the agent's CPU time
and RSS from /proc/<pid>/stat and /proc/<pid>/status.

Why 100 µs per call: an NVML query is an ioctl into the NVIDIA kernel driver;
simple ones (utilization, temperature) take tens of µs, power, ECC and the
process list up to a few hundred on a busy 8-GPU node. 100 µs for every call,
spent as CPU in the agent (an ioctl's time is kernel time charged to the
caller), is a pessimistic middle.

    python -m bench.agent            # 60 s measured, after its first report and a 5 s warm-up
    python -m bench.agent --quick    # 15 s measured

The last line is ``RESULT {json}`` with cpu_pct (percent of one core) and
rss_mb (peak resident set, MiB).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TARGET_CPU_PCT = 1.0
TARGET_RSS_MB = 60.0


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # utime and stime are fields 14 and 15 of the line, 12 and 13 after the ")".
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def child(args: argparse.Namespace) -> None:
    """The agent under test (``--child``)."""
    from tests.agent.fake_nvml import eight_gpus
    from tide.services.agent.agent import Agent
    from tide.services.agent.attribution import PodResourcesClient
    from tide.services.agent.nvml import NvmlSource
    from tide.services.agent.settings import AgentSettings
    from tide.services.agent.sink import SingleStream
    from tide.services.common import logs

    logs.configure("WARNING")
    settings = AgentSettings(
        scaler=f"127.0.0.1:{args.port}",
        node_name="bench-node",
        interval_s=args.interval_s,
        watch_node=False,
        pod_resources_socket=args.socket,
    )
    nv = eight_gpus(call_cost_s=args.call_cost_us / 1e6)

    async def main() -> None:
        agent = Agent(
            settings,
            NvmlSource(nv),
            pod_resources=PodResourcesClient(args.socket, timeout_s=5.0),
        )
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await agent.run(stop)
        sink = agent.sink
        assert isinstance(sink, SingleStream)  # one scaler here: no --scaler-fanout
        print(
            json.dumps(
                {
                    "sampled": sink.buffer.added_total,
                    "acked": sink.buffer.acked_seq,
                    "nvml_calls": nv.calls,
                }
            ),
            flush=True,
        )

    asyncio.run(main())


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import grpc

    from tests.agent.telemetry_server import TelemetryRecorder, start_server
    from tide.services.agent.podresources import api_pb2, api_pb2_grpc

    class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
        async def List(self, request: Any, context: Any) -> Any:
            pods = [
                api_pb2.PodResources(
                    name=f"trainer-{i}",
                    namespace="ml",
                    containers=[
                        api_pb2.ContainerResources(
                            name="worker",
                            devices=[
                                api_pb2.ContainerDevices(
                                    resource_name="nvidia.com/gpu",
                                    device_ids=[f"GPU-{i:08x}-0000-0000-0000-000000000000"],
                                )
                            ],
                        )
                    ],
                )
                for i in range(8)
            ]
            return api_pb2.ListPodResourcesResponse(pod_resources=pods)

    recorder = TelemetryRecorder()
    server, port = await start_server(recorder)
    tmp = tempfile.mkdtemp(prefix="tide-bench-")
    socket = os.path.join(tmp, "kubelet.sock")
    kubelet = grpc.aio.server()
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(Kubelet(), kubelet)
    kubelet.add_insecure_port(f"unix://{socket}")
    await kubelet.start()

    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "bench.agent",
        "--child",
        f"--port={port}",
        f"--socket={socket}",
        f"--interval-s={args.interval_s}",
        f"--call-cost-us={args.call_cost_us}",
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
    )
    pid = proc.pid
    try:
        # Imports, first connect, first PodResources call: until the first report
        # arrives (a loaded machine takes seconds), then the warm-up proper.
        started = time.monotonic()
        while not recorder.received:
            if proc.returncode is not None or time.monotonic() - started > 60:
                raise SystemExit("the agent sent no report within 60 s")
            await asyncio.sleep(0.05)
        await asyncio.sleep(args.warmup_s)
        cpu0, t0, seen0 = _cpu_seconds(pid), time.monotonic(), len(recorder.received)
        rss_samples: list[int] = []
        while time.monotonic() - t0 < args.seconds:
            rss_samples.append(_status_kb(pid, "VmRSS"))
            await asyncio.sleep(1.0)
        cpu1, t1, seen1 = _cpu_seconds(pid), time.monotonic(), len(recorder.received)
        hwm_kb = _status_kb(pid, "VmHWM")
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await server.stop(None)
        await kubelet.stop(None)
    child_stats = json.loads(out.decode().strip().splitlines()[-1])
    wall = t1 - t0
    return {
        "cpu_pct": round(100.0 * (cpu1 - cpu0) / wall, 3),
        "rss_mb": round(max(rss_samples) / 1024, 1),
        "rss_peak_mb": round(hwm_kb / 1024, 1),
        "measured_s": round(wall, 1),
        "reports_per_s": round((seen1 - seen0) / wall, 2),
        "gpus": 8,
        "interval_s": args.interval_s,
        "call_cost_us": args.call_cost_us,
        "nvml_calls": child_stats["nvml_calls"],
        "reports_acked": child_stats["acked"],
        "cpu_target_pct": TARGET_CPU_PCT,
        "rss_target_mb": TARGET_RSS_MB,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.agent", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="15 s instead of 60 s")
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--interval-s", type=float, default=1.0)
    parser.add_argument("--call-cost-us", type=float, default=100.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--socket", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    if args.seconds is None:
        args.seconds = 15.0 if args.quick else 60.0
    result = asyncio.run(measure(args))
    ok_cpu = result["cpu_pct"] <= TARGET_CPU_PCT
    ok_rss = result["rss_mb"] <= TARGET_RSS_MB
    rows = [
        ("agent CPU, % of one core", f"{result['cpu_pct']:.3f}", f"<= {TARGET_CPU_PCT}", ok_cpu),
        (
            "agent RSS, MiB (max of 1 s samples)",
            f"{result['rss_mb']:.1f}",
            f"<= {TARGET_RSS_MB}",
            ok_rss,
        ),
        ("agent RSS peak (VmHWM), MiB", f"{result['rss_peak_mb']:.1f}", "", True),
        ("reports/s received", f"{result['reports_per_s']:.2f}", f"{1 / args.interval_s:g}", True),
    ]
    print(
        f"agent at {1 / args.interval_s:g} Hz, 8 GPUs, NVML stand-in at "
        f"{args.call_cost_us:g} us/call, {result['measured_s']:.0f} s measured"
    )
    print(f"{'quantity':<40} {'value':>10} {'target':>10}  ok")
    for name, value, target, ok in rows:
        print(f"{name:<40} {value:>10} {target:>10}  {'yes' if ok else 'NO'}")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
