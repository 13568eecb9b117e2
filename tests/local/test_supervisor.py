"""The supervisor with real child processes: start order, readiness, failures, stop order."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.procs import ROOT
from tide.base.errors import ConfigError, Unavailable
from tide.services.local.supervisor import ChildSpec, ChildState, Supervisor

pytestmark = pytest.mark.component

SERVICE = (sys.executable, "-m", "tests.common.sample_service", "--listen", "127.0.0.1:0")


def py(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


async def serving(port: int) -> bool:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)


@pytest.fixture
def sup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Supervisor:
    monkeypatch.chdir(ROOT)
    return Supervisor(tmp_path / "logs")


async def test_services_start_listen_and_stop_in_reverse_order(sup: Supervisor) -> None:
    try:
        first = await sup.start(ChildSpec("coordinator", SERVICE))
        second = await sup.start(ChildSpec("scaler", SERVICE))
        assert first.state is second.state is ChildState.READY
        assert first.port and second.port and first.port != second.port
        assert await serving(first.port) and await serving(second.port)
        assert first.target == f"127.0.0.1:{first.port}"
    finally:
        codes = await sup.stop_all()
    assert list(codes) == ["scaler", "coordinator"]  # last started, first stopped
    assert codes == {"scaler": 0, "coordinator": 0}
    assert "LISTENING" in (sup.log_dir / "scaler.log").read_text()


async def test_a_child_that_dies_at_start_is_reported_with_its_log(sup: Supervisor) -> None:
    with pytest.raises(Unavailable, match=r"(?s)broken exited with code 3.*bad flag --x"):
        await sup.start(
            ChildSpec(
                "broken", py("import sys; print('bad flag --x', file=sys.stderr); sys.exit(3)")
            )
        )
    with pytest.raises(Unavailable, match=r"(?s)exited with code 2.*no such setting"):
        await sup.start(
            ChildSpec(
                "noisy", py("import sys; print('no such setting', file=sys.stderr); sys.exit(2)")
            )
        )


async def test_a_silent_child_times_out_and_is_stopped(sup: Supervisor) -> None:
    with pytest.raises(Unavailable, match=r"did not listen within 0\.5 s"):
        await sup.start(ChildSpec("silent", py("import time; time.sleep(60)"), ready_timeout_s=0.5))
    assert sup.children[0].state is ChildState.EXITED
    assert sup.children[0].proc.returncode == -signal.SIGTERM


async def test_a_child_ignoring_sigterm_is_killed(sup: Supervisor) -> None:
    stubborn = py(
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('LISTENING grpc=1 metrics=None', flush=True); time.sleep(60)"
    )
    child = await sup.start(ChildSpec("stubborn", stubborn, stop_grace_s=0.3))
    assert child.port == 1 and child.metrics_port is None
    assert await sup.stop(child) == -signal.SIGKILL


async def test_wait_any_exit_names_the_child_that_died(sup: Supervisor) -> None:
    try:
        await sup.start(
            ChildSpec("steady", py("import time; time.sleep(60)"), wait_listening=False)
        )
        await sup.start(
            ChildSpec(
                "crashy",
                py("import time; time.sleep(0.3); raise SystemExit(7)"),
                wait_listening=False,
            )
        )
        dead = await sup.wait_any_exit()
        assert dead.name == "crashy" and dead.proc.returncode == 7
        assert dead.state is ChildState.EXITED
    finally:
        codes = await sup.stop_all()
    assert codes["steady"] == -signal.SIGTERM


def test_spec_validation() -> None:
    with pytest.raises(ConfigError, match="name"):
        ChildSpec("Bad Name", ("x",))
    with pytest.raises(ConfigError, match="argv"):
        ChildSpec("ok", ())
    with pytest.raises(ConfigError, match="stop_grace_s"):
        ChildSpec("ok", ("x",), stop_grace_s=-1)
