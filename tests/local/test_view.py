"""The demo's view, summary and settings, as pure functions."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from tide.base.errors import ConfigError, FailedPrecondition
from tide.services.local.demo import (
    DemoSettings,
    Outcome,
    Phase,
    goal_reached,
    next_job_id,
    next_phase,
    summary_lines,
)
from tide.services.local.samples import SampleAudit
from tide.services.local.view import DecisionView, PlainLines, Snapshot, render
from tide.v1 import common_pb2, scaler_pb2

pytestmark = pytest.mark.unit


def snap(t: float, **kw: object) -> Snapshot:
    base: dict[str, object] = dict(
        elapsed_s=t,
        phase="high load",
        load_pct=95.0,
        job_id="demo/run-1",
        replicas=2,
        window_mean_pct=93.0,
        coverage=1.0,
        generation=1,
        world_size=2,
        step=40,
        samples_per_s=1200.0,
        resize_phase="",
        last_evaluation="NOT_SUSTAINED: 3 of 5 buckets",
    )
    base.update(kw)
    return Snapshot(**base)  # type: ignore[arg-type]


GROW = DecisionView(
    1,
    2,
    4,
    "SUSTAINED_HIGH_UTILIZATION",
    "ACTUATING",
    (("PENDING", 20.0), ("ACTUATING", 20.1)),
    0.0,
    0,
)


def test_plain_lines_report_changes_and_a_periodic_status() -> None:
    p = PlainLines(every_s=5)
    first = p.lines(snap(1.0))
    assert first[0] == "[   1.0s] phase high load: synthetic GPU load 95%"
    assert any("generation 1: world size 2" in ln for ln in first)
    assert any("replicas 2, step 40, 1200 samples/s, GPU util 93%" in ln for ln in first)
    assert p.lines(snap(2.0)) == []  # nothing changed, status not due
    lines = p.lines(snap(3.0, decisions=(GROW,), resize_phase="WAITING_FOR_MEMBERS"))
    assert lines == ["[   3.0s] decision 1 2→4 (SUSTAINED_HIGH_UTILIZATION): ACTUATING"]
    done = DecisionView(1, 2, 4, "SUSTAINED_HIGH_UTILIZATION", "COMPLETED", (), 1.25, 0)
    lines = p.lines(snap(6.5, decisions=(done,), generation=2, world_size=4))
    assert (
        "[   6.5s] decision 1 2→4 (SUSTAINED_HIGH_UTILIZATION): COMPLETED, pause 1.25 s,"
        " lost steps 0" in lines
    )
    assert any("generation 2: world size 4" in ln for ln in lines)
    assert any(ln.startswith("[   6.5s] replicas") for ln in lines)


def test_live_view_shows_the_job_and_each_decision_trail() -> None:
    console = Console(width=80, record=True)
    console.print(render(snap(12.0, decisions=(GROW,), resize_phase="CHECKPOINTING")))
    text = console.export_text()
    assert "demo/run-1" in text and "high load" in text and "CHECKPOINTING" in text
    assert "PENDING 20.0 → ACTUATING 20.1" in text and "high util" in text
    assert "NOT_SUSTAINED: 3 of 5 buckets" in text
    console = Console(width=200, record=True)
    console.print(render(snap(1.0)))
    assert "no decisions yet" in console.export_text()


def test_summary_lists_decisions_lost_steps_and_the_audit(tmp_path: Path) -> None:
    d = scaler_pb2.DecisionDetail()
    d.decision.id, d.decision.from_replicas, d.decision.to_replicas = 7, 2, 4
    d.decision.reason = common_pb2.DECISION_REASON_SUSTAINED_HIGH_UTILIZATION
    d.decision.state = common_pb2.DECISION_STATE_COMPLETED
    d.decision.pause_s = 2.5
    d.decision.created_at.FromSeconds(1000)
    for state, at in (
        (common_pb2.DECISION_STATE_PENDING, 1000),
        (common_pb2.DECISION_STATE_COMPLETED, 1012),
    ):
        e = d.events.add(state=state)
        e.at.FromSeconds(at)
    good = SampleAudit(120, 120, 7680, (1, 2), ((1, 2), (2, 4)), (), (), (), (121,))
    out = Outcome("demo/run-3", Phase.DONE, 80.0, [d], good, tmp_path / "demo.png")
    assert out.ok
    text = "\n".join(summary_lines(out, tmp_path))
    assert "demo demo/run-3: OK in 80 s" in text
    assert "decision 7: 2 → 4 (SUSTAINED_HIGH_UTILIZATION) COMPLETED; pause 2.50 s" in text
    assert "PENDING +0.0s → COMPLETED +12.0s" in text
    assert "lost steps: 0" in text and "exactly once: 7680 samples in 120 steps" in text
    assert "steps 121 were in flight" in text
    assert f"tide history demo/run-3 --db sqlite:///{tmp_path.resolve()}/tide.db" in text

    redone = SampleAudit(120, 120, 7680, (1, 2), ((1, 2), (2, 4)), (61, 62), (), (), ())
    bad = Outcome("demo/run-3", Phase.DONE, 80.0, [d], redone)
    assert bad.lost_steps == 2 and not bad.ok
    assert "FAILED" in summary_lines(bad, tmp_path)[0]
    assert not Outcome("demo/run-3", Phase.FAILED, 9.0, [], good).ok


def test_each_run_is_a_new_job(tmp_path: Path) -> None:
    assert next_job_id(tmp_path) == "demo/run-1"
    for n in (1, 2, 5):
        (tmp_path / "jobs" / f"demo__run-{n}").mkdir(parents=True)
    (tmp_path / "jobs" / "demo__run-x").mkdir()
    assert next_job_id(tmp_path) == "demo/run-6"


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"start_replicas": 4, "max_replicas": 4}, "start_replicas"),
        ({"high_pct": 70}, "high_pct"),
        ({"sustain_s": 0}, "sustain_s"),
        ({"hold_s": -1}, "hold_s"),
        ({"cycles": 0}, "cycles"),
        ({"global_batch": 10_000}, "global_batch"),
        ({"workload": "pipeline"}, "workload"),
    ],
)
def test_demo_settings_validation(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        DemoSettings(**kw)  # type: ignore[arg-type]


def test_tide_demo_refuses_an_unknown_workload_in_one_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from tide.services.cli.main import app

    r = CliRunner().invoke(app, ["demo", "--workload", "pipeline", "--state-dir", str(tmp_path)])
    assert r.exit_code == 2
    assert r.stderr.strip().splitlines() == [
        "tide: workload: one of mlp, sharded, got 'pipeline'"
    ], r.stderr
    assert not (tmp_path / "tide.db").exists()  # refused before anything started


@pytest.mark.parametrize(
    ("phase", "done", "cycles", "expected"),
    [
        (Phase.STARTING, 0, 1, Phase.HIGH),
        (Phase.HIGH, 0, 1, Phase.LOW),
        (Phase.LOW, 1, 1, Phase.DONE),
        (Phase.LOW, 1, 2, Phase.HIGH),
        (Phase.LOW, 2, 2, Phase.DONE),
    ],
    ids=["start", "high", "last-low", "another-cycle", "second-cycle-done"],
)
def test_next_phase(phase: Phase, done: int, cycles: int, expected: Phase) -> None:
    assert next_phase(phase, done, cycles) is expected


def test_next_phase_of_a_final_phase_is_refused() -> None:
    with pytest.raises(FailedPrecondition):
        next_phase(Phase.DONE, 1, 1)


SHRINK_DONE = DecisionView(2, 4, 2, "SUSTAINED_LOW_UTILIZATION", "COMPLETED", (), 0.9, 0)
GROW_DONE = DecisionView(1, 2, 4, "SUSTAINED_HIGH_UTILIZATION", "COMPLETED", (), 1.2, 0)


@pytest.mark.parametrize(
    ("phase", "kw", "earlier", "reached"),
    [
        (Phase.STARTING, {"generation": 0, "step": 0}, set(), False),
        (Phase.STARTING, {"generation": 1, "step": 3}, set(), True),
        (Phase.HIGH, {"replicas": 4, "decisions": (GROW,)}, set(), False),
        (Phase.HIGH, {"replicas": 2, "decisions": (GROW_DONE,)}, set(), False),
        (Phase.HIGH, {"replicas": 4, "decisions": (GROW_DONE,)}, set(), True),
        (Phase.HIGH, {"replicas": 4, "decisions": (GROW_DONE,)}, {1}, False),
        (Phase.LOW, {"replicas": 2, "decisions": (GROW_DONE,)}, set(), False),
        (Phase.LOW, {"replicas": 2, "decisions": (GROW_DONE, SHRINK_DONE)}, {1}, True),
    ],
    ids=[
        "no-gen",
        "training",
        "grow-running",
        "replicas-lag",
        "grown",
        "old-grow",
        "no-shrink",
        "shrunk",
    ],
)
def test_goal_reached(
    phase: Phase, kw: dict[str, object], earlier: set[int], reached: bool
) -> None:
    assert goal_reached(phase, snap(5.0, **kw), DemoSettings(), earlier) is reached
