"""The CLI in kubectl's shape, against the real scaler process (in-memory coordinator and
actuator): job apply, scale --wait, history -w, -o table|wide|json|yaml|jsonpath,
--no-headers, plain tables off a terminal, --version, completion, compound durations."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.support.poll import wait_for
from tests.support.procs import ROOT, ServiceProcess, start_memory_scaler
from tide.services.cli.main import app

pytestmark = pytest.mark.integration

TOKEN = "t0ken"
#: A streaming command exits within this of SIGINT, seconds (issue 30).
SIGINT_EXIT_S = 1.0
runner = CliRunner()

JOB_YAML = """\
job_id: ml/applied
initial_replicas: 2
gpus_per_replica: 1
policy:
  min_replicas: 2
  max_replicas: 6
  cooldown_s: 600
---
job_id: ml/second
policy: {min_replicas: 1, max_replicas: 3}
"""


@pytest.fixture(scope="module")
def scaler(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    db = tmp_path_factory.mktemp("kubectl") / "tide.db"
    svc = start_memory_scaler(f"sqlite:///{db}", "--admin-token", TOKEN)
    try:
        yield svc
    finally:
        svc.terminate()


def tide(*args: str, stdin: str | None = None) -> tuple[int, str, str]:
    r = runner.invoke(app, list(args), input=stdin)
    return r.exit_code, r.stdout, r.stderr


@pytest.fixture(scope="module")
def applied(scaler: ServiceProcess, tmp_path_factory: pytest.TempPathFactory) -> ServiceProcess:
    f = tmp_path_factory.mktemp("spec") / "job.yaml"
    f.write_text(JOB_YAML)
    code, out, err = tide("job", "apply", "-f", str(f), "--scaler", scaler.target, "--token", TOKEN)
    assert code == 0, err
    assert "job ml/applied configured" in out and "job ml/second configured" in out
    wait_for(lambda: _replicas(scaler, "ml/applied") == 2, timeout_s=20, what="ml/applied started")
    return scaler


def _replicas(scaler: ServiceProcess, job: str) -> int:
    _, out, _ = tide("jobs", "--scaler", scaler.target, "-o", "json")
    return {j["job_id"]: j["current_replicas"] for j in json.loads(out)["jobs"]}.get(job, -1)


def test_job_apply_creates_and_updates_jobs(applied: ServiceProcess) -> None:
    code, out, _ = tide("jobs", "--scaler", applied.target, "-o", "json")
    jobs = {j["job_id"]: j for j in json.loads(out)["jobs"]}
    assert jobs["ml/applied"]["policy"]["cooldown_s"] == 600.0
    assert (jobs["ml/second"]["min_replicas"], jobs["ml/second"]["max_replicas"]) == (1, 3)
    # From stdin, an update: the new bound only; -o yaml prints what the scaler answers.
    update = "job_id: ml/second\npolicy: {max_replicas: 4}\n"
    code, out, err = tide(
        "job", "apply", "-f", "-", "-o", "yaml", "--scaler", applied.target, "--token", TOKEN,
        stdin=update,
    )  # fmt: skip
    assert code == 0, err
    (job,) = yaml.safe_load(out)["jobs"]
    assert (job["job_id"], job["max_replicas"], job["min_replicas"]) == ("ml/second", 4, 1)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("job_id: ml/x\npolicy: {max_replica: 3}\n", "max_replica"),
        ("job_id: ml/x\ninitial_replicas: many\n", "initial_replicas"),
        ("policy: {max_replicas: 3}\n", "job_id is required"),
        ("- just\n- a list\n", "expected a mapping"),
    ],
)
def test_job_apply_refuses_a_bad_file_naming_the_field(
    scaler: ServiceProcess, spec: str, message: str
) -> None:
    code, _, err = tide(
        "job", "apply", "-f", "-", "--scaler", scaler.target, "--token", TOKEN, stdin=spec
    )
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_scale_wait_follows_the_decision_to_completed(applied: ServiceProcess) -> None:
    code, out, err = tide(
        "scale", "ml/applied", "--replicas", "3", "--reason", "more", "--wait",
        "--wait-timeout", "1m", "--scaler", applied.target, "--token", TOKEN,
    )  # fmt: skip
    assert code == 0, err
    assert "COMPLETED: ml/applied runs 3" in out
    assert "ACTUATING" in err  # the states as they happened


def test_output_formats_and_plain_tables(applied: ServiceProcess) -> None:
    target = ("--scaler", applied.target)
    code, out, _ = tide("jobs", *target, "-o", "jsonpath={.jobs[*].job_id}")
    assert code == 0 and out.split() == ["ml/applied", "ml/second"]
    code, out, _ = tide("jobs", *target, "-o", "$.jobs[?(@.job_id=='ml/second')].max_replicas")
    assert code == 2  # a bare expression is not a format
    code, out, _ = tide("jobs", *target, "-o", "jsonpath=$.jobs[0].policy.cooldown_s")
    assert out.strip() == "600.0"
    # Off a terminal a table is plain columns: no box drawing, awk can cut it.
    code, out, _ = tide("jobs", *target)
    assert code == 0 and not any(ch in out for ch in "│┃━─┏┡")
    header, *rows = out.splitlines()
    assert header.split()[:3] == ["JOB", "REPLICAS", "MIN..MAX"]
    assert [r.split()[0] for r in rows] == ["ml/applied", "ml/second"]
    _, wide, _ = tide("jobs", *target, "-o", "wide")
    assert "GPUS/REPLICA" in wide.splitlines()[0] and "COVERAGE" in wide.splitlines()[0]
    _, bare, _ = tide("jobs", *target, "--no-headers")
    assert [r.split()[0] for r in bare.splitlines()] == ["ml/applied", "ml/second"]
    code, out, _ = tide("history", "all", *target, "--since", "1h30m", "-o", "yaml")
    doc = yaml.safe_load(out)
    assert doc["kind"] == "tide.history" and len(doc["decisions"]) >= 1
    _, hist, _ = tide("history", "ml/applied", *target, "-o", "wide", "--no-headers")
    assert all("│" not in line for line in hist.splitlines())
    code, _, err = tide("history", "all", *target, "-o", "xml")
    assert code == 2 and "jsonpath=EXPR" in err


def test_history_watch_prints_the_history_then_every_change(applied: ServiceProcess) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tide.services.cli", "history", "ml/applied", "-w", "-o", "json",
         "--scaler", applied.target],
        cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As a background job of a non-interactive shell (CI) starts it: SIGINT ignored,
        # which the CLI must take back (the cause of a flake that hung here).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        # The history document comes first (pretty JSON up to its closing brace).
        lines = []
        while not lines or lines[-1] != "}\n":
            line = proc.stdout.readline()
            assert line, proc.stderr.read() if proc.stderr else ""
            lines.append(line)
        history = json.loads("".join(lines))
        assert history["kind"] == "tide.history"
        # Whatever the module's other tests left it at: a resize is to a new size.
        replicas = 3 if _replicas(applied, "ml/applied") == 2 else 2
        code, _, err = tide(
            "scale", "ml/applied", "--replicas", str(replicas), "--reason", "other",
            "--scaler", applied.target, "--token", TOKEN,
        )  # fmt: skip
        assert code == 0, err
        states = []
        while "COMPLETED" not in states:
            event = json.loads(proc.stdout.readline())
            assert event["kind"] == "tide.decision_event"
            assert event["decision"]["reason"] == "MANUAL"
            states.append(event["state"])
        assert states[0] == "PENDING"
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0
        assert time.monotonic() - t0 <= SIGINT_EXIT_S  # issue 30: a user's Ctrl-C
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_scale_wait_exits_130_within_a_second_of_ctrl_c(tmp_path: Path) -> None:
    # A scaler that accepts and never answers: the CLI is blocked in its first call.
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        proc = subprocess.Popen(
            [sys.executable, "-m", "tide.services.cli", "scale", "ml/x", "--replicas", "2",
             "--reason", "r", "--wait", "--timeout-s", "60", "--token", TOKEN,
             "--scaler", f"127.0.0.1:{mute.getsockname()[1]}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )  # fmt: skip
        try:
            wait_for(lambda: _connected(mute), what="the CLI connected")
            proc.send_signal(signal.SIGINT)
            t0 = time.monotonic()
            assert proc.wait(timeout=10) == 130
            assert time.monotonic() - t0 <= SIGINT_EXIT_S
            assert proc.stderr is not None and "Traceback" not in proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


def _connected(server: socket.socket) -> bool:
    server.settimeout(0.1)
    try:
        conn, _ = server.accept()
    except TimeoutError:
        return False
    conn.detach()  # left open: the CLI waits on it
    return True


def test_history_watch_needs_the_scaler() -> None:
    code, _, err = tide("history", "all", "-w", "--db", "sqlite:///nowhere.db")
    assert code == 2 and "--watch" in err


def test_version_completion_and_compound_durations(tmp_path: Path) -> None:
    code, out, _ = tide("--version")
    assert code == 0 and out.startswith("tide ")
    r = subprocess.run(
        [sys.executable, "-m", "tide.services.cli", "--show-completion", "bash"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"},
    )
    assert r.returncode == 0 and "complete" in r.stdout, r.stderr
    code, _, err = tide("history", "all", "--since", "30m1h", "--db", "sqlite:///x.db")
    assert code == 2 and "largest first" in err
