"""`tide whatif` on a history the real scaler wrote: under the policy it ran with, the
replay makes exactly the decisions that were recorded (the self-check); under a
stricter one, others."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.scaler.service_rig import T0, make_rig
from tests.scaler.test_goodput import Load
from tests.support.poll import eventually
from tide.services.cli.main import app
from tide.services.store import db
from tide.services.testing.clock import FakeClock

pytestmark = pytest.mark.component

POLICY = {
    "bucket_s": 2.0,
    "sustain_s": 10.0,
    "cooldown_s": 10.0,
    "scale_down_stabilization_s": 0.0,
    "min_replicas": 2,
    "max_replicas": 6,
}


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, tz=UTC).isoformat()


async def record(url: str) -> float:
    """A job's history as the scaler writes it: high, low, high again. Returns the end."""
    rig = make_rig(url, FakeClock(T0))
    await rig.core.start()
    try:
        await rig.core.upsert_job("ns/a", POLICY, gpus_per_replica=1)
        await eventually(lambda: "uid-a-1" in rig.core.registry.by_uid)
        load = Load(rig)
        for util in (95.0, 15.0, 95.0, 50.0):
            await load.run(40, {"ns/a": util})
        await rig.core.flush_rollups(final=True)
        return rig.clock.now()
    finally:
        await rig.core.close()
        rig.store.engine.dispose()


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, float]:
    url = f"sqlite:///{tmp_path_factory.mktemp('whatif') / 'tide.db'}"
    db.upgrade(url)
    return url, asyncio.run(record(url))


def whatif(url: str, end: float, *extra: str) -> dict[str, object]:
    r = CliRunner().invoke(
        app,
        [
            "whatif",
            "ns/a",
            "--db",
            url,
            "--since",
            iso(T0 - 60),
            "--until",
            iso(end + 60),
            "-o",
            "json",
            *extra,
        ],
    )
    assert r.exit_code == 0, r.stderr
    doc: dict[str, object] = json.loads(r.stdout)
    return doc


def test_the_recorded_policy_reproduces_the_recorded_decisions(history: tuple[str, float]) -> None:
    url, end = history
    doc = whatif(url, end)
    real = doc["real"]["decisions"]  # type: ignore[index]
    sizes = [(d["from_replicas"], d["to_replicas"]) for d in real]
    assert sizes[:2] == [(2, 4), (4, 6)] and (6, 2) in sizes, sizes
    (replay,) = doc["replays"]  # type: ignore[misc]
    assert replay["reproduces_recorded"], replay
    assert [
        (d["from_replicas"], d["to_replicas"], d["recorded_id"]) for d in replay["decisions"]
    ] == [(d["from_replicas"], d["to_replicas"], d["id"]) for d in real]
    assert abs(replay["gpu_hours"] - doc["real"]["gpu_hours"]) < 0.01  # type: ignore[index]


def test_a_stricter_policy_decides_otherwise(history: tuple[str, float], tmp_path: Path) -> None:
    url, end = history
    strict = tmp_path / "strict.yaml"
    strict.write_text("scale_up_utilization_pct: 97\n")
    # Utilization as recorded whatever the size: the job never shows more than 95 %.
    doc = whatif(url, end, "--policy", str(strict), "--load-model", "same")
    recorded, other = doc["replays"]  # type: ignore[misc]
    assert other["name"] == "strict" and other["policy"]["scale_up_utilization_pct"] == 97
    assert other["load_model"] == "same" and recorded["reproduces_recorded"]
    assert not other["reproduces_recorded"]
    # It never grows, and nothing shrinks below 2: no decision at all, fewer GPU-hours.
    assert other["decisions"] == []
    assert other["gpu_hours"] < recorded["gpu_hours"]
    # The same work on fewer GPUs (the default): 2 GPUs doing 4's work are at 100 %, so
    # the strict policy grows too, later than the recorded one did.
    doc = whatif(url, end, "--policy", str(strict))
    recorded, other = doc["replays"]  # type: ignore[misc]
    first_real = doc["real"]["decisions"][0]["at_s"]  # type: ignore[index]
    assert other["decisions"] and other["decisions"][0]["at_s"] > first_real + 2


def test_the_table_and_bad_input(history: tuple[str, float], tmp_path: Path) -> None:
    url, end = history
    runner = CliRunner()
    args = ["whatif", "ns/a", "--db", url, "--since", iso(T0 - 60), "--until", iso(end + 60)]
    r = runner.invoke(app, args)
    assert r.exit_code == 0 and "reproduces every recorded policy decision" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("sustain_s: 7\n")
    r = runner.invoke(app, [*args, "--policy", str(bad)])
    assert r.exit_code == 2 and "sustain_s=7" in r.stderr
    r = runner.invoke(app, ["whatif", "ns/none", "--db", url])
    assert r.exit_code == 1
