"""The hostile suite for a while, and what authentication costs telemetry ingest.

A scaler and a coordinator run in this process with the production servicers, rules,
guard and validation (tide.services.testing.stack), with mTLS from a fresh CA:

1. forged: every forged or unauthenticated shape on every link
   (tide.services.testing.hostile.forged_calls), each must be refused and write nothing;
2. malformed: Hypothesis-drawn requests of edge values and garbage bytes to every
   method of every service, round after round, none may end UNKNOWN or INTERNAL;
3. both servers still answer;
4. overhead: telemetry ingest (8 agents streaming 8-GPU reports as fast as the scaler
   takes them) into an mTLS scaler, each agent with its node's certificate and the
   identity checked on every report, against a plaintext scaler, same run, same load,
   alternating rounds; ``auth_overhead_pct`` is how much lower the mTLS rate is
   (median of the rounds; target within 15 %).

    python -m bench.security            # about 60 s per phase
    python -m bench.security --quick    # about 12 s per phase

The last line is ``RESULT {json}`` with forged_tried, forged_accepted (must be 0),
malformed_tried, unknown_or_internal (must be 0), servers_alive (1 or 0),
auth_overhead_pct, and the two ingest rates.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

AGENTS = 8
GPUS = 8


async def _ingest_round(stack: Any, seconds: float, round_no: int) -> float:
    """Reports per second the scaler accepted from AGENTS streams in ``seconds``."""
    import grpc

    from tide.v1 import telemetry_pb2, telemetry_pb2_grpc

    engine = stack.core.ingest
    start: int = engine.reports_accepted
    stop_at = time.monotonic() + seconds

    async def agent(k: int) -> None:
        node = f"bench-{k}"
        issued = stack.ca.agent(node) if stack.ca is not None else None
        async with stack.channel(stack.scaler_target, issued) as ch:
            stub: Any = telemetry_pb2_grpc.TelemetryStub(ch)
            call = stub.Stream()
            reader = asyncio.create_task(_drain(call))
            report = telemetry_pb2.NodeReport(
                node_name=node, boot_id=f"r{round_no}", gpu_capacity=GPUS
            )
            for i in range(GPUS):
                report.gpus.add(index=i, uuid=f"GPU-{k}-{i}", utilization_pct=60.0)
            seq = 0
            while time.monotonic() < stop_at:
                seq += 1
                report.seq = seq
                report.sampled_at.GetCurrentTime()
                await call.write(report)
            await call.done_writing()
            with contextlib.suppress(grpc.aio.AioRpcError):
                await reader

    t0 = time.monotonic()
    await asyncio.gather(*(agent(k) for k in range(AGENTS)))
    accepted: int = engine.reports_accepted - start
    return accepted / (time.monotonic() - t0)


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from tide.services.testing import hostile
    from tide.services.testing.stack import start_stack

    phase_s = 12.0 if args.quick else 60.0
    with tempfile.TemporaryDirectory(prefix="tide-bench-security-") as tmp:
        root = Path(tmp)
        secure = await start_stack(root / "mtls")
        plain = await start_stack(root / "plain", tls=False)
        try:
            forged = await hostile.run_forged(secure, root)
            print(f"forged: {hostile.summary(forged)}", flush=True)

            malformed = hostile.Tally()
            seed = 0
            end = time.monotonic() + phase_s
            while time.monotonic() < end:
                t = await hostile.run_malformed(secure, per_method=4, seed=seed)
                malformed.tried += t.tried
                malformed.bad += t.bad
                malformed.codes.update(t.codes)
                malformed.examples += t.examples[: 10 - len(malformed.examples)]
                seed += 1
            print(f"malformed: {hostile.summary(malformed)}", flush=True)
            alive = await hostile.servers_alive(secure)

            rounds = max(2, int(phase_s // 3))
            round_s = phase_s / rounds
            rates: dict[str, list[float]] = {"plain": [], "mtls": []}
            for r in range(rounds):
                # Alternating, so a neighbour's load on a shared machine hits both alike.
                order = (("plain", plain), ("mtls", secure))
                for name, stack in order if r % 2 == 0 else reversed(order):
                    rates[name].append(await _ingest_round(stack, round_s / 2, r))
            print(f"ingest reports/s: {rates}", flush=True)
        finally:
            await secure.close()
            await plain.close()
    plain_rate = statistics.median(rates["plain"])
    mtls_rate = statistics.median(rates["mtls"])
    return {
        "forged_tried": forged.tried,
        "forged_accepted": forged.bad,
        "malformed_tried": malformed.tried,
        "unknown_or_internal": malformed.bad,
        "servers_alive": int(alive),
        "auth_overhead_pct": round((plain_rate - mtls_rate) / plain_rate * 100, 1),
        "ingest_plain_reports_per_s": round(plain_rate),
        "ingest_mtls_reports_per_s": round(mtls_rate),
        "agents": AGENTS,
        "gpus_per_report": GPUS,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.security", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="about 12 s per phase")
    args = parser.parse_args(argv)
    # The refusals are the point here; their (rate-limited) lines would drown the output.
    logging.basicConfig(level=logging.ERROR)
    result = asyncio.run(measure(args))
    print("RESULT " + json.dumps(result), flush=True)
    ok = result["forged_accepted"] == 0 and result["unknown_or_internal"] == 0
    return 0 if ok and result["servers_alive"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
