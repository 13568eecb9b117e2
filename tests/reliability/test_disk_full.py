"""Reliability catalog, issue 16 item 4: the disk under the store, or under the
checkpoints, fills up or turns read-only (docs/reliability.md).

A small tmpfs made by the test (tests/support/faults.py) is filled with a file of
zeros, or remounted read-only. What must hold:
- the scaler on SQLite fails loudly: readiness NOT_SERVING within 2 s (liveness
  stays), one error log line naming the cause, ``tide_store_up`` 0 and
  ``tide_store_outages_total{cause="disk_full"}`` counted; writes answer UNAVAILABLE;
- nothing half-written: the database passes ``PRAGMA integrity_check``, every
  decision acked before is there and the refused one is not;
- it recovers by itself, no restart, once the file is removed;
- a checkpoint that cannot be written leaves no temporary directory and the latest
  good checkpoint loads; the next write after space returns succeeds.
"""

from __future__ import annotations

import sqlite3
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.faults import fill, remount, small_tmpfs
from tests.support.poll import wait_for
from tests.support.procs import start_memory_scaler
from tide.services.common.readiness import LIVENESS
from tide.services.store.probe import MIN_FREE_BYTES, StoreDown, check_writable
from tide.trainer.checkpoint import CheckpointStore
from tide.v1 import scaler_pb2, scaler_pb2_grpc

pytestmark = [pytest.mark.integration]

JOB = "ns/disk"
T = 10.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(target: str, service: str = "") -> int:
    with grpc.insecure_channel(target) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=2.0
            )
        except grpc.RpcError:
            return -1
        return int(resp.status)


def sample(metrics_port: int | None, series: str) -> float:
    """One series' value, ``series`` as the exposition writes it (labels included)."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(series + " "):
                return float(line.split()[-1])
    raise AssertionError(f"{series} not exported")


@pytest.mark.slow
def test_scaler_on_a_full_disk_fails_loudly_and_resumes_when_space_returns() -> None:
    with small_tmpfs(MIN_FREE_BYTES * 3) as disk:
        scaler = start_memory_scaler(
            f"sqlite:///{disk / 'tide.db'}",
            "--metrics-listen",
            "127.0.0.1:0",
            "--log-level",
            "ERROR",
        )
        ch = grpc.insecure_channel(scaler.target)
        stub = scaler_pb2_grpc.ScalerStub(ch)
        try:
            stub.UpsertJob(
                scaler_pb2.UpsertJobRequest(
                    job_id=JOB,
                    initial_replicas=2,
                    policy=scaler_pb2.Policy(min_replicas=1, max_replicas=4, cooldown_s=0.0),
                ),
                timeout=T,
            )
            wait_for(
                lambda: (
                    stub.GetJob(scaler_pb2.GetJobRequest(job_id=JOB), timeout=T).current_replicas
                ),
                timeout_s=30,
                what="the job's start",
            )
            acked = {d.id for d in stub.ListDecisions(scaler_pb2.ListDecisionsRequest()).decisions}
            assert acked

            outages = 'tide_store_outages_total{cause="disk_full"}'
            before = sample(scaler.metrics_port, outages)
            t_full = time.monotonic()
            filler = fill(disk)
            wait_for(lambda: health(scaler.target) == NOT_SERVING, timeout_s=5, what="NOT_SERVING")
            detected_s = time.monotonic() - t_full
            assert detected_s < 2.0
            assert health(scaler.target, LIVENESS) == SERVING
            assert sample(scaler.metrics_port, "tide_store_up") == 0
            assert sample(scaler.metrics_port, outages) == before + 1
            with pytest.raises(grpc.RpcError) as err:
                stub.RequestResize(
                    scaler_pb2.RequestResizeRequest(
                        job_id=JOB, replicas=3, reason="disk full", requested_by="t"
                    ),
                    timeout=T,
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value

            t_space = time.monotonic()
            filler.unlink()
            wait_for(lambda: health(scaler.target) == SERVING, timeout_s=5, what="SERVING again")
            recovered_s = time.monotonic() - t_space
            assert recovered_s < 2.0
            print(
                f"disk_full not_serving_after_s={detected_s:.2f} serving_after_s={recovered_s:.2f}"
            )
            resized = stub.RequestResize(
                scaler_pb2.RequestResizeRequest(
                    job_id=JOB, replicas=3, reason="space is back", requested_by="t"
                ),
                timeout=T,
            )
            assert resized.id not in acked
            after = stub.ListDecisions(scaler_pb2.ListDecisionsRequest()).decisions
            assert acked <= {d.id for d in after}
            assert [d.id for d in after if "disk full" in d.message] == []
        finally:
            ch.close()
            scaler.kill()
        _, err_text = scaler.proc.communicate(timeout=10)
        lines = [line for line in err_text.splitlines() if "store unavailable" in line]
        assert len(lines) == 1, lines
        assert "bytes free" in lines[0]
        with sqlite3.connect(disk / "tide.db") as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_the_probe_finds_a_read_only_store_disk() -> None:
    # A mount with a database open to write cannot be remounted read-only (EBUSY),
    # so the running scaler meets a read-only disk only at its own start; this is
    # the check its probe runs, on a file system that really is read-only.
    with small_tmpfs(MIN_FREE_BYTES * 2) as disk:
        check_writable(disk, MIN_FREE_BYTES)
        remount(disk, "ro")
        with pytest.raises(StoreDown) as down:
            check_writable(disk, MIN_FREE_BYTES)
        assert down.value.cause == "read_only"
        remount(disk, "rw")
        check_writable(disk, MIN_FREE_BYTES)


def _files(step: int, size: int) -> dict[str, bytes]:
    return {"model.pdparams": bytes([step % 256]) * size, "opt.pdopt": b"o" * 64}


def test_a_checkpoint_that_cannot_be_written_leaves_the_last_good_one() -> None:
    with small_tmpfs(4 << 20) as disk:
        store = CheckpointStore(disk / "ckpt", keep=3)
        store.write(1, _files(1, 1 << 16), {"step": 1})
        filler = fill(disk)
        with pytest.raises(OSError):
            store.write(2, _files(2, 1 << 20), {"step": 2})
        assert sorted(p.name for p in store.root.iterdir() if ".tmp-" in p.name) == []
        assert store.load_latest().step == 1

        filler.unlink()  # space is back: the next write succeeds
        store.write(2, _files(2, 1 << 20), {"step": 2})
        assert store.load_latest().step == 2

        remount(disk, "ro")
        try:
            with pytest.raises(OSError):
                store.write(3, _files(3, 1 << 10), {"step": 3})
            assert store.load_latest().step == 2
        finally:
            remount(disk, "rw")
        assert store.cleanup_tmp() == 0
