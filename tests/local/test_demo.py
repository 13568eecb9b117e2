"""`tide demo` end to end, as CI runs it (stdout not a terminal): real scaler, coordinator,
launchers and Paddle workers; then the history it left is read back offline."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.procs import ROOT
from tide.services.local.logscan import warnings_in

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.paddle]


def tide(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tide.services.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


@pytest.mark.timeout(300)
def test_demo_scales_2_4_2_and_loses_nothing(tmp_path: Path) -> None:
    # mTLS on every link (a CA made under the state dir), and an admin token set on the
    # scaler and the coordinator: the scaler presents it on its Resize calls.
    state = tmp_path / "tide"
    token = "tide-demo-admin-token-" + os.urandom(8).hex()
    token_file = tmp_path / "admin-token"
    token_file.write_text(token + "\n")
    r = tide(
        "demo",
        "--state-dir",
        str(state),
        "--log-format",
        "json",
        "--admin-token-file",
        str(token_file),
        timeout_s=280,
    )
    out = r.stdout
    assert r.returncode == 0, out + r.stderr[-3000:]
    # A healthy run is quiet (issue 32): no WARNING or ERROR, not even before the first line.
    assert not [ln for ln in (out + r.stderr).splitlines() if " WARNING " in ln or " ERROR " in ln]
    # Plain progress lines, not a live view, when stdout is a pipe.
    assert "[" in out and "phase high load: synthetic GPU load 95%" in out
    assert "phase low load: synthetic GPU load 15%" in out
    assert "\x1b[" not in out
    # The scaler started the job itself, then grew and shrank it.
    assert "decision 1: 0 → 2 (JOB_STARTED) COMPLETED" in out
    assert "decision 2: 2 → 4 (SUSTAINED_HIGH_UTILIZATION) COMPLETED" in out
    assert "decision 3: 4 → 2 (SUSTAINED_LOW_UTILIZATION) COMPLETED" in out
    assert "lost steps: 0" in out
    assert "every sample consumed exactly once" in out and "g1×2, g2×4, g3×2" in out
    chart = state / "demo.png"
    assert chart.read_bytes()[:4] == b"\x89PNG"

    db = f"sqlite:///{state / 'tide.db'}"
    hist = tide("history", "demo/run-1", "--db", db, "-o", "json", timeout_s=60)
    assert hist.returncode == 0, hist.stderr
    decisions = json.loads(hist.stdout)["decisions"]
    assert [(d["from_replicas"], d["to_replicas"], d["state"]) for d in decisions] == [
        (4, 2, "COMPLETED"),
        (2, 4, "COMPLETED"),
        (0, 2, "COMPLETED"),
    ]
    start = decisions[-1]
    assert (start["reason"], start["trigger"], start["generation"]) == ("JOB_STARTED", "MANUAL", 1)
    assert all(d["pause_s"] > 0 and d["lost_steps"] == 0 for d in decisions[:2])
    explain = tide("explain", str(decisions[1]["id"]), "--db", db, "-o", "json", timeout_s=60)
    doc = json.loads(explain.stdout)
    assert doc["inputs"]["policy"]["sustain_s"] == 10.0
    assert all(b is None or b > 80 for b in doc["inputs"]["window"]["bucket_means_pct"])
    assert [e["state"] for e in doc["events"]][-1] == "COMPLETED"
    assert_job_lines_carry_their_ids(state / "logs", "demo/run-1")
    assert warnings_in(state / "logs") == []  # a healthy run is quiet, teardown included
    assert (state / "pki" / "ca.pem").is_file()
    assert_no_secrets_in_logs(state / "logs", token, state / "pki")
    # Nothing of the run is left behind.
    leftovers = [
        p for p in Path("/proc").iterdir() if p.name.isdigit() and str(state) in _cmdline(p)
    ]
    assert leftovers == []


def assert_job_lines_carry_their_ids(logs: Path, job_id: str) -> None:
    """Every JSON line of every service and launcher that is about the job (names it,
    names a decision or resize, or is the launcher's) carries ``job_id``; one naming a
    decision carries ``decision_id``. Each log has JSON lines (the launchers' too)."""
    missing: list[str] = []
    for f in sorted(logs.glob("*.log")):
        lines = 0
        for raw in f.read_text().splitlines():
            try:
                doc = json.loads(raw)
            except ValueError:
                continue  # a worker's own output (Paddle's warnings) in a pod's log
            if not isinstance(doc, dict) or "msg" not in doc:
                continue
            lines += 1
            msg = doc["msg"]
            decision = re.search(r"\b(?:decision|resize) (\d+)", msg)
            about_job = job_id in msg or decision or doc["logger"].startswith("tide.trainer.")
            if about_job and doc.get("job_id") != job_id:
                missing.append(f"{f.name}: no job_id: {raw}")
            if decision and doc.get("decision_id") is None:
                missing.append(f"{f.name}: no decision_id: {raw}")
        assert lines > 0, f"{f.name} has no JSON log line"
    assert missing == []


def assert_no_secrets_in_logs(logs: Path, token: str, pki: Path) -> None:
    """No service or launcher log holds the admin token or any private key's material."""
    secrets = [token, "PRIVATE KEY"]
    for key in pki.rglob("*-key.pem"):
        secrets += [line for line in key.read_text().splitlines() if "-----" not in line]
    for key in logs.parent.rglob("pods/*/launcher-key.pem"):
        secrets += [line for line in key.read_text().splitlines() if "-----" not in line]
    found = [
        f"{f.name}: {secret[:12]}..."
        for f in sorted(logs.glob("*.log"))
        for secret in secrets
        if secret and secret in f.read_text(errors="replace")
    ]
    assert len(secrets) > 5 and found == []


def _cmdline(p: Path) -> str:
    try:
        return (p / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.timeout(240)
def test_ctrl_c_stops_the_demo_cleanly_and_still_audits(tmp_path: Path) -> None:
    state = tmp_path / "tide"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tide.services.cli", "demo", "--state-dir", str(state), "--plain"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
                seen.append(line)
                if "phase high load" in line:
                    break
        assert any("phase high load" in ln for ln in seen), "".join(seen)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    out = "".join(seen) + rest
    assert proc.returncode == 4, out  # a demo that did not finish has failed (exit 4)
    assert "interrupted in phase high load" in out and "FAILED" in out
    assert "stopping the job and the control plane" in out
    # What ran before the interruption was still consumed exactly once.
    assert "every sample consumed exactly once" in out
    assert [
        p for p in Path("/proc").iterdir() if p.name.isdigit() and str(state) in _cmdline(p)
    ] == []
