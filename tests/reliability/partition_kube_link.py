"""The partitioned link between the scaler and the Kubernetes API server (run by
partition_driver.py inside the server namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.reliability.partition_common import (
    API_JOB_NAME,
    API_REQUEST_TIMEOUT_S,
    LogTail,
    poll_until,
)
from tests.scaler.kube_world import PADDLE_OPERATOR, cluster, paddle_operator_job
from tests.support.netns import CLIENT_ADDR, NetnsPair
from tests.support.procs import ROOT
from tide.base.errors import Unavailable
from tide.services.common.clock import SystemClock
from tide.services.scaler.actuators.kubernetes import KubernetesActuator, KubernetesActuatorSettings
from tide.services.scaler.engine.core import ScalerCore
from tide.services.scaler.store import DecisionStore
from tide.services.store import db
from tide.services.testing.coordinator import InMemoryCoordinator


async def apiserver_peer(workdir: str) -> None:
    """The API server's side, run in the client namespace: the emulated cluster (API
    server, operators, a GPU node) with one PaddleJob of 2 workers, reached through a
    forwarder on every address (the emulator listens on loopback only). Writes
    ``kubeconfig`` into ``workdir`` and prints ``UP``; on stdin's close prints
    ``FINAL {json}`` with the requests the API server saw."""
    with cluster(Path(workdir), gpus=8) as world:
        world.api.create(PADDLE_OPERATOR, paddle_operator_job(API_JOB_NAME, 2))

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            writer.close()

        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", world.api.port)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

        server = await asyncio.start_server(accept, "0.0.0.0", 0)
        port = server.sockets[0].getsockname()[1]
        kubeconfig = json.loads(world.kubeconfig.read_text())
        kubeconfig["clusters"][0]["cluster"]["server"] = f"http://{CLIENT_ADDR}:{port}"
        (Path(workdir) / "kubeconfig").write_text(json.dumps(kubeconfig))
        print("UP", flush=True)
        await asyncio.to_thread(sys.stdin.read)
        server.close()
        job = world.api.get(PADDLE_OPERATOR, "default", API_JOB_NAME)
        final = {
            "patches": world.api.stats.requests["PATCH"],
            "replicas": job["spec"]["worker"]["replicas"],
        }
        print("FINAL " + json.dumps(final), flush=True)


def scaler_apiserver(pair: NetnsPair, db_url: str) -> dict[str, object]:
    """The scaler's core here with the Kubernetes actuator; the emulated API server in the
    client namespace; a grow 2 -> 3 is decided while the link is cut."""
    workdir = Path(tempfile.mkdtemp(prefix="tide-part-"))
    peer = subprocess.Popen(
        [
            *pair.exec_in("client"),
            sys.executable,
            "-m",
            "tests.reliability.partition_driver",
            "apiserver-peer",
            str(workdir),
        ],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        return asyncio.run(_scaler_apiserver(pair, db_url, workdir, peer))
    finally:
        # Its FINAL line comes before its cluster stops the emulated pods: killed at once,
        # it left them running past the test. Its stdin closed tells it to stop (already
        # closed unless the run failed before).
        if peer.stdin is not None:
            peer.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            peer.wait(timeout=30)
        if peer.poll() is None:
            peer.kill()
            peer.wait(timeout=10)


async def _scaler_apiserver(
    pair: NetnsPair, db_url: str, workdir: Path, peer: subprocess.Popen[str]
) -> dict[str, object]:
    out = LogTail(peer, stdout=True)
    assert peer.stdin is not None
    await poll_until(lambda: out.first(0.0, "UP"), timeout_s=60)
    actuator = KubernetesActuator(
        KubernetesActuatorSettings(
            source=str(workdir / "kubeconfig"),
            request_timeout_s=API_REQUEST_TIMEOUT_S,
            pod_wait_s=2.0,
        )
    )
    coordinator = InMemoryCoordinator()
    coordinator.available = lambda job_id: 8  # the grow's newcomers are there
    clock = SystemClock()
    await asyncio.to_thread(db.upgrade, db_url)
    store = DecisionStore(db.make_engine(db_url), "partition", clock)
    core = ScalerCore(store=store, actuator=actuator, coordinator=coordinator, clock=clock)
    job_id = f"default/{API_JOB_NAME}"
    try:
        await core.start()
        await core.upsert_job(job_id, {"cooldown_s": 0.0, "min_replicas": 1, "max_replicas": 8})
        coordinator.adopt(job_id, 2)
        # Every call on the cut link ends within its timeout (+ urllib3's own retries
        # of an idempotent read): measured on a bare read.
        t0 = pair.cut()
        try:
            await actuator.get_replicas(job_id)
            read_error = ""
        except Unavailable as exc:
            read_error = str(exc)
        read_s = time.monotonic() - t0
        d = await core.request_resize(job_id, 3, "across a partition", "t")
        # The decision meets the cut link for a while: a few of its actuator calls fail.
        await asyncio.sleep(3 * API_REQUEST_TIMEOUT_S)
        during = (await store.get_decision(d.id)).decision
        t_heal = pair.heal()
        task = core.controller.tasks.get(d.id)
        if task is not None:
            await asyncio.wait_for(task, 60)
        done_s = time.monotonic() - t_heal
        after = (await store.get_decision(d.id)).decision
    finally:
        await core.close()
        actuator.stop()
        store.engine.dispose()
    peer.stdin.close()
    final = await poll_until(lambda: out.first(t_heal, "FINAL "), timeout_s=15)
    seen = json.loads(final[1][len("FINAL ") :])
    return {
        "link": "scaler-apiserver",
        "method": pair.method,
        "read_s": round(read_s, 3),
        "read_error": read_error,
        "state_during": during.state.name,
        "final_state": after.state.name,
        "completed_after_heal_s": round(done_s, 3),
        "patches": seen["patches"],
        "replicas": seen["replicas"],
    }
