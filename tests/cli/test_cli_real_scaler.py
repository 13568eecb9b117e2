"""Every `tide` command against the real scaler process (`python -m tide.services.testing.scaler`:
the production code with the in-memory actuator and coordinator), over its socket, with
its admin token."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from tests.support.poll import wait_for
from tests.support.procs import ServiceProcess, start_memory_scaler
from tide.services.cli.main import app
from tide.v1 import scaler_pb2, scaler_pb2_grpc

pytestmark = pytest.mark.integration

TOKEN = "t0ken"
JOB = "ml/real"
runner = CliRunner()


@pytest.fixture(scope="module")
def scaler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    db = tmp_path_factory.mktemp("real") / "tide.db"
    svc = start_memory_scaler(f"sqlite:///{db}", "--admin-token", TOKEN)
    try:
        with grpc.insecure_channel(svc.target) as ch:
            scaler_pb2_grpc.ScalerStub(ch).UpsertJob(
                scaler_pb2.UpsertJobRequest(
                    job_id=JOB,
                    policy=scaler_pb2.Policy(min_replicas=2, max_replicas=6),
                ),
                timeout=10,
                metadata=(("authorization", f"Bearer {TOKEN}"),),
            )
        yield svc
    finally:
        svc.terminate()


def tide(*args: str) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


def test_jobs(scaler: ServiceProcess) -> None:
    code, out, err = tide("jobs", "--scaler", scaler.target, "-o", "json")
    assert code == 0, err
    (job,) = json.loads(out)["jobs"]
    assert job["job_id"] == JOB and job["min_replicas"] == 2 and job["max_replicas"] == 6
    assert job["policy"]["sustain_s"] == 300.0  # the scaler's default, merged


def test_scale_history_explain_chart(scaler: ServiceProcess, tmp_path: Path) -> None:
    code, out, err = tide(
        "scale", JOB, "--replicas", "4", "--reason", "load test", "--as", "bob",
        "--scaler", scaler.target, "--token", TOKEN,
    )  # fmt: skip
    assert code == 0, err
    did = int(out.split()[1].rstrip(":"))

    def history() -> list[dict[str, object]]:
        c, o, _ = tide("history", JOB, "--scaler", scaler.target, "-o", "json")
        assert c == 0
        return list(json.loads(o)["decisions"])

    done = wait_for(
        lambda: [d for d in history() if d["id"] == did and d["state"] == "COMPLETED"],
        timeout_s=30,
        what="the manual decision to complete",
    )
    assert done[0]["reason"] == "MANUAL" and done[0]["requested_by"] == "bob"
    assert (done[0]["from_replicas"], done[0]["to_replicas"]) == (2, 4)

    code, out, _ = tide("explain", str(did), "--scaler", scaler.target)
    assert code == 0 and "MANUAL" in out and "COMPLETED" in out and "load test" in out
    code, out, err = tide("history", JOB, "--scaler", scaler.target, "--state", "aborted")
    assert code == 0 and out == "" and "no decisions" in err
    png = tmp_path / "real.png"
    code, out, err = tide(
        "chart", JOB, "--since", "1h", "--out", str(png), "--scaler", scaler.target
    )
    assert code == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_pause_resume(scaler: ServiceProcess) -> None:
    code, out, _ = tide("pause", JOB, "--reason", "INC-1", "--scaler", scaler.target,
                        "--token", TOKEN)  # fmt: skip
    assert code == 0 and "paused: INC-1" in out
    _, out, _ = tide("jobs", "--scaler", scaler.target, "-o", "json")
    assert json.loads(out)["jobs"][0]["pause_reason"] == "INC-1"
    code, _, _ = tide("resume", JOB, "--scaler", scaler.target, "--token", TOKEN)
    assert code == 0
    _, out, _ = tide("jobs", "--scaler", scaler.target, "-o", "json")
    assert json.loads(out)["jobs"][0]["autoscaling_paused"] is False


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("history", "ml/none"), 1),
        (("explain", "424242"), 1),
        (("chart", "ml/none", "--out", "/tmp/none.png"), 1),
        (("scale", "ml/none", "--replicas", "3", "--reason", "x", "--token", TOKEN), 1),
        (("pause", "ml/none", "--reason", "x", "--token", TOKEN), 1),
        (("resume", "ml/none", "--token", TOKEN), 1),
        (("scale", JOB, "--replicas", "9", "--reason", "x", "--token", TOKEN), 2),
        (("scale", JOB, "--replicas", "3", "--reason", "x", "--token", "wrong"), 2),
        (("pause", JOB, "--reason", "x"), 2),
    ],
)
def test_exit_codes(scaler: ServiceProcess, args: tuple[str, ...], code: int) -> None:
    got, _, err = tide(*args, "--scaler", scaler.target)
    assert got == code, err
    assert err.startswith("tide: ") and err.count("\n") == 1
