"""Every `tide` command and exit code against a Scaler served over a real socket."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.cli.fake_scaler import FakeScaler, Served, serve_in_thread
from tests.support.procs import ROOT
from tide.services.cli import read, source
from tide.services.cli.main import app
from tide.services.cli.render import CSV_COLUMNS
from tide.services.testing.ports import free_port
from tide.v1 import common_pb2

pytestmark = pytest.mark.component

JOB = "ml/resnet"
TOKEN = "s3cret"
NOW = datetime.now(tz=UTC).replace(microsecond=0)


@pytest.fixture
def served() -> Iterator[Served]:
    fake = FakeScaler()
    fake.add_job(JOB, replicas=4)
    fake.add_job("ml/idle", replicas=2)
    fake.add_decision(JOB, 2, 4, NOW - timedelta(hours=30))  # outside the default 24h
    fake.add_decision(
        JOB,
        4,
        2,
        NOW - timedelta(hours=3),
        reason=common_pb2.DECISION_REASON_SUSTAINED_LOW_UTILIZATION,
    )
    fake.add_decision(JOB, 2, 4, NOW - timedelta(hours=1), state=common_pb2.DECISION_STATE_ABORTED)
    fake.add_decision(JOB, 2, 4, NOW - timedelta(minutes=20))
    fake.add_decision("ml/idle", 2, 3, NOW - timedelta(minutes=10))
    for m in range(-15, 16):
        fake.add_rollup(
            JOB,
            (NOW - timedelta(minutes=20)).replace(second=0) + timedelta(minutes=m),
            90.0,
            2 if m < 1 else 4,
        )
    yield from serve_in_thread(fake, admin_token=TOKEN)


@pytest.fixture
def dead_target() -> str:
    """An address where nothing listens: bound, then closed."""
    return f"127.0.0.1:{free_port()}"


runner = CliRunner()


def tide(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def one_line_error(stderr: str, *words: str) -> None:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("tide: "), stderr
    for w in words:
        assert w in lines[0], (w, stderr)


# --- jobs -----------------------------------------------------------------------------------


def test_jobs_table_lists_every_job(served: Served) -> None:
    code, out, _ = tide("jobs", "--scaler", served.target)
    assert code == 0
    assert JOB in out and "ml/idle" in out
    assert "2..8" in out


def test_jobs_json_is_the_documented_schema(served: Served) -> None:
    code, out, _ = tide("jobs", "--scaler", served.target, "-o", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["schema_version"] == 1 and doc["kind"] == "tide.jobs"
    assert (doc["source"], doc["unavailable_fields"], doc["policy_scope"]) == (
        "scaler",
        [],
        "effective",
    )
    by_id = {j["job_id"]: j for j in doc["jobs"]}
    assert by_id[JOB]["current_replicas"] == 4
    assert by_id[JOB]["min_replicas"] == 2 and by_id[JOB]["max_replicas"] == 8
    assert by_id[JOB]["policy"]["sustain_s"] == 300
    assert by_id[JOB]["autoscaling_paused"] is False


def test_unreachable_scaler_exits_3(dead_target: str) -> None:
    code, _, err = tide("jobs", "--scaler", dead_target, "--timeout-s", "2")
    assert code == 3
    one_line_error(err, dead_target, "unreachable")


# --- history --------------------------------------------------------------------------------


def test_history_default_range_is_24h_newest_first(served: Served) -> None:
    code, out, _ = tide("history", JOB, "--scaler", served.target, "-o", "json")
    assert code == 0
    doc = json.loads(out)
    assert doc["kind"] == "tide.history" and doc["job_id"] == JOB
    created = [d["created_at"] for d in doc["decisions"]]
    assert len(created) == 3  # the 30 h old one is out of range
    assert created == sorted(created, reverse=True)
    first = doc["decisions"][0]
    assert set(first) == set(CSV_COLUMNS)
    assert first["reason"] == "SUSTAINED_HIGH_UTILIZATION"
    assert first["state"] == "COMPLETED" and first["trigger"] == "POLICY"
    assert first["created_at"].endswith("Z") and first["pause_s"] == 1.5


def test_history_since_until_and_state_filters(served: Served) -> None:
    since = (NOW - timedelta(hours=2)).isoformat()
    code, out, _ = tide(
        "history",
        JOB,
        "--scaler",
        served.target,
        "-o",
        "json",
        "--since",
        "48h",
        "--until",
        since,
        "--state",
        "completed",
    )
    assert code == 0
    got = json.loads(out)["decisions"]
    assert [(d["from_replicas"], d["to_replicas"]) for d in got] == [(4, 2), (2, 4)]
    code, out, _ = tide(
        "history", JOB, "--scaler", served.target, "-o", "json", "--state", "ABORTED,failed"
    )
    assert [d["state"] for d in json.loads(out)["decisions"]] == ["ABORTED"]


def test_history_all_jobs(served: Served) -> None:
    code, out, _ = tide("history", "all", "--scaler", served.target, "-o", "json")
    assert code == 0
    assert {d["job_id"] for d in json.loads(out)["decisions"]} == {JOB, "ml/idle"}


def test_history_pages_through_every_decision(served: Served) -> None:
    for i in range(source.PAGE_SIZE + 7):
        served.scaler.add_decision("ml/idle", 2, 3, NOW - timedelta(minutes=30, seconds=i))
    served.scaler.list_calls = 0
    code, out, _ = tide("history", "ml/idle", "--all", "--scaler", served.target, "-o", "json")
    assert code == 0
    ids = [d["id"] for d in json.loads(out)["decisions"]]
    assert len(ids) == len(set(ids)) == source.PAGE_SIZE + 8
    assert served.scaler.list_calls == 2


def test_history_shows_a_first_page_by_default_like_kubectl(served: Served) -> None:
    for i in range(507):
        served.scaler.add_decision("ml/idle", 2, 3, NOW - timedelta(minutes=30, seconds=i))
    served.scaler.list_calls = 0
    code, out, err = tide("history", "ml/idle", "--scaler", served.target)
    assert code == 0
    assert len(out.splitlines()) == 1 + read.DEFAULT_LIMIT
    assert "showing the newest 100; more with --limit N or --all" in err
    # One call, no bigger than the page shown.
    assert (served.scaler.list_calls, served.scaler.page_sizes) == (1, [read.DEFAULT_LIMIT])

    served.scaler.list_calls, served.scaler.page_sizes = 0, []
    code, out, err = tide(
        "history", "ml/idle", "--limit", "600", "--chunk-size", "250", "--scaler", served.target
    )
    assert code == 0 and len(out.splitlines()) == 1 + 508 and "showing" not in err
    assert served.scaler.page_sizes == [250, 250, 100]

    # --all streams every row as a plain table, one header, columns aligned by the first page.
    served.scaler.list_calls, served.scaler.page_sizes = 0, []
    code, out, err = tide(
        "history", "ml/idle", "--all", "--chunk-size", "200", "--scaler", served.target
    )
    lines = out.splitlines()
    assert code == 0 and len(lines) == 1 + 508 and lines[0].startswith("ID ")
    assert served.scaler.page_sizes == [200, 200, 200]
    assert len({line.index("ml/idle") for line in lines[1:]}) == 1
    code, out, _ = tide(
        "history", "ml/idle", "--all", "--chunk-size", "200", "-o", "csv", "--scaler", served.target
    )
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 508 and len({r["id"] for r in rows}) == 508
    code, _, err = tide("history", "ml/idle", "--chunk-size", "2000", "--scaler", served.target)
    assert code == 2


def test_history_table_and_csv(served: Served) -> None:
    code, out, _ = tide("history", JOB, "--scaler", served.target)
    assert code == 0
    assert "SUSTAINED_LOW_UTILIZATION" in out and "4→2" in out and "ABORTED" in out
    code, out, _ = tide("history", JOB, "--scaler", served.target, "--output", "csv")
    assert code == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert len(rows) == 3 and tuple(rows[0]) == CSV_COLUMNS
    assert rows[0]["to_replicas"] == "4"


def test_history_of_unknown_job_exits_1(served: Served) -> None:
    code, _, err = tide("history", "ml/nope", "--scaler", served.target)
    assert code == 1
    one_line_error(err, "ml/nope")


@pytest.mark.parametrize(
    ("args", "word"),
    [
        (("--since", "yesterday"), "--since"),
        (("--until", "24h", "--since", "1h"), "before"),
        (("--state", "DONE"), "--state"),
        (("--output", "xml"), ""),
    ],
)
def test_history_bad_usage_exits_2(served: Served, args: tuple[str, ...], word: str) -> None:
    code, _, err = tide("history", JOB, "--scaler", served.target, *args)
    assert code == 2
    assert word in err


def test_history_unreachable_exits_3(dead_target: str) -> None:
    code, _, err = tide("history", JOB, "--scaler", dead_target, "--timeout-s", "2")
    assert code == 3
    one_line_error(err, "unreachable")


# --- explain --------------------------------------------------------------------------------


def test_explain_shows_inputs_thresholds_states_and_utilization(served: Served) -> None:
    did = max(served.scaler.decisions)  # ml/idle's; use the job's latest instead
    did = max(i for i, s in served.scaler.decisions.items() if s.decision.job_id == JOB)
    code, out, _ = tide("explain", str(did), "--scaler", served.target)
    assert code == 0, out
    assert f"Decision {did}" in out and "2 → 4" in out
    assert "91% 94% - 95%" in out  # bucket means, the empty bucket as '-'
    assert "scale up above 80%" in out and "sustain 300 s" in out
    assert "PREPARING" in out and "ACTUATING" in out and "+   4.00s" in out
    assert "pause 1.50 s, lost steps 0" in out
    assert "◀ decision" in out and "replicas 4" in out


def test_explain_json(served: Served) -> None:
    did = min(served.scaler.decisions)
    code, out, _ = tide(
        "explain", str(did), "--scaler", served.target, "-o", "json", "--context-minutes", "5"
    )
    assert code == 0
    doc = json.loads(out)
    assert doc["kind"] == "tide.explain" and doc["decision"]["id"] == did
    assert doc["inputs"]["window"]["bucket_means_pct"] == [91.0, 93.5, None, 95.0]
    assert doc["inputs"]["policy"]["scale_up_utilization_pct"] == 80
    assert [e["state"] for e in doc["events"]] == ["PENDING", "PREPARING", "ACTUATING", "COMPLETED"]


def test_explain_unknown_decision_exits_1(served: Served) -> None:
    code, _, err = tide("explain", "9999", "--scaler", served.target)
    assert code == 1
    one_line_error(err, "9999")


def test_explain_bad_id_exits_2(served: Served) -> None:
    code, _, _ = tide("explain", "abc", "--scaler", served.target)
    assert code == 2


# --- admin ----------------------------------------------------------------------------------


def test_scale_creates_a_manual_decision(served: Served) -> None:
    code, out, _ = tide(
        "scale",
        "ml/idle",
        "--replicas",
        "5",
        "--reason",
        "load test",
        "--as",
        "alice",
        "--scaler",
        served.target,
        "--token",
        TOKEN,
    )
    assert code == 0, out
    assert "2 → 5" in out and "PENDING" in out
    d = served.scaler.decisions[max(served.scaler.decisions)].decision
    assert (d.to_replicas, d.message, d.requested_by) == (5, "load test", "alice")
    assert d.trigger == common_pb2.DECISION_TRIGGER_MANUAL


def test_scale_token_comes_from_the_environment(served: Served) -> None:
    result = runner.invoke(
        app,
        ["scale", "ml/idle", "--replicas", "3", "--reason", "x", "--scaler", served.target],
        env={"TIDE_ADMIN_TOKEN": TOKEN},
    )
    assert result.exit_code == 0, result.stderr


def test_scale_wait_requests_nothing_when_the_watch_is_refused(served: Served) -> None:
    # The fake serves no WatchDecisions: the stream ends with its status alone, which
    # also answers the wait for its headers. That is no subscription: nothing is asked.
    before = dict(served.scaler.decisions)
    code, _, err = tide(
        "scale", "ml/idle", "--replicas", "3", "--reason", "x", "--wait",
        "--scaler", served.target, "--token", TOKEN,
    )  # fmt: skip
    assert code != 0 and "decision" not in err, err
    assert served.scaler.decisions == before


@pytest.mark.parametrize(
    ("args", "code", "word"),
    [
        (("ml/idle", "--replicas", "9", "--reason", "x"), 2, "outside 2..8"),
        (("ml/idle", "--replicas", "3", "--reason", "  "), 2, "--reason"),
        (("ml/nope", "--replicas", "3", "--reason", "x"), 1, "ml/nope"),
        (("ml/idle", "--replicas", "0", "--reason", "x"), 2, ""),
    ],
)
def test_scale_refusals(served: Served, args: tuple[str, ...], code: int, word: str) -> None:
    got, _, err = tide("scale", *args, "--scaler", served.target, "--token", TOKEN)
    assert got == code
    assert word in err


def test_admin_call_without_token_is_refused(served: Served) -> None:
    code, _, err = tide("pause", JOB, "--reason", "incident", "--scaler", served.target)
    assert code == 2
    one_line_error(err, "admin", "Bearer")
    assert not served.scaler.jobs[JOB].autoscaling_paused


def test_pause_and_resume(served: Served) -> None:
    code, out, _ = tide(
        "pause", JOB, "--reason", "INC-42", "--scaler", served.target, "--token", TOKEN
    )
    assert code == 0 and "paused: INC-42" in out
    assert served.scaler.jobs[JOB].autoscaling_paused
    _, out, _ = tide("jobs", "--scaler", served.target)
    assert "paused: INC-42" in out
    code, out, _ = tide("resume", JOB, "--scaler", served.target, "--token", TOKEN)
    assert code == 0 and "resumed" in out
    assert not served.scaler.jobs[JOB].autoscaling_paused


def test_pause_needs_a_reason_and_a_known_job(served: Served) -> None:
    assert tide("pause", JOB, "--reason", "", "--scaler", served.target, "--token", TOKEN)[0] == 2
    assert (
        tide("pause", "ml/x", "--reason", "r", "--scaler", served.target, "--token", TOKEN)[0] == 1
    )
    assert tide("resume", "ml/x", "--scaler", served.target, "--token", TOKEN)[0] == 1


@pytest.mark.parametrize(
    "cmd",
    [
        ("scale", JOB, "--replicas", "3", "--reason", "x"),
        ("pause", JOB, "--reason", "x"),
        ("resume", JOB),
        ("explain", "1"),
        ("chart", JOB, "--out", "/tmp/unreachable.png"),
    ],
)
def test_every_other_command_unreachable_exits_3(dead_target: str, cmd: tuple[str, ...]) -> None:
    code, _, err = tide(*cmd, "--scaler", dead_target, "--timeout-s", "2")
    assert code == 3
    one_line_error(err, "unreachable")


# --- chart ----------------------------------------------------------------------------------


def test_chart_writes_a_png(served: Served, tmp_path: Path) -> None:
    out = tmp_path / "c" / "job.png"
    code, text, _ = tide(
        "chart", JOB, "--since", "2h", "--out", str(out), "--scaler", served.target
    )
    assert code == 0, text
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "2 decisions" in text and "31 minutes" in text
    # One ListUtilization call for the range, not one GetDecision per decision.
    assert len(served.scaler.utilization_calls) == 1


def test_chart_reads_minutes_far_from_any_decision_and_long_ranges(
    served: Served, tmp_path: Path
) -> None:
    minute = (NOW - timedelta(days=10)).replace(second=0)
    served.scaler.add_rollup("ml/idle", minute, 55.0, 2)
    out = tmp_path / "idle.png"
    code, text, _ = tide(
        "chart", "ml/idle", "--since", "2w", "--out", str(out), "--scaler", served.target
    )
    assert code == 0, text
    assert "(1 minutes, 1 decisions)" in text
    # Two weeks in parts of at most a week, back to back.
    calls = served.scaler.utilization_calls
    assert len(calls) == 3
    assert all(b - a <= timedelta(days=7) for a, b in calls)
    assert all(calls[i][1] == calls[i + 1][0] for i in range(len(calls) - 1))


@pytest.mark.parametrize(
    ("args", "code"),
    [
        (("ml/nope", "--out", "x.png"), 1),
        ((JOB, "--out", "x.txt"), 2),
        ((JOB, "--out", "x.png", "--since", "soon"), 2),
    ],
)
def test_chart_refusals(served: Served, tmp_path: Path, args: tuple[str, ...], code: int) -> None:
    got, _, _ = tide(
        "chart", *[a.replace("x.", str(tmp_path / "x.")) for a in args], "--scaler", served.target
    )
    assert got == code


# --- the installed entry point --------------------------------------------------------------


def test_entry_point_exit_codes_and_one_line(dead_target: str) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tide.services.cli", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = run("jobs", "--scaler", dead_target, "--timeout-s", "1")
    assert r.returncode == 3 and r.stderr.count("\n") == 1, r.stderr
    r = run("history")
    assert r.returncode == 2
