"""Reliability catalog T06/T07: a link cut for real between two network namespaces
(tests/support/netns.py), then healed (docs/reliability.md).

Skipped unless root with ``ip`` and ``tc``. Each test runs a driver inside the
server namespace (partition_driver.py) and checks its RESULT line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.coordinator.fakes import TIMEOUT_S as FAKE_CALL_TIMEOUT_S
from tests.coordinator.test_process import HEARTBEAT_S
from tests.reliability import partition_common as drv
from tests.support.netns import NetnsPair, netns_pair
from tests.support.procs import ROOT

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.serial]


def drive(pair: NetnsPair, link: str, *args: str, timeout_s: float = 90.0) -> dict[str, Any]:
    done = subprocess.run(
        [
            *pair.exec_in("server"),
            sys.executable,
            "-m",
            "tests.reliability.partition_driver",
            link,
            pair.server,
            pair.client,
            pair.server_dev,
            pair.client_dev,
            *args,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines and lines[-1].startswith("RESULT "), done.stderr[-3000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    print(f"{link} {json.dumps(result)}")  # the figures docs/reliability.md quotes (-s)
    return result


def test_agent_scaler_partition_is_detected_within_keepalive_and_heals(tmp_path: Path) -> None:
    with netns_pair("as") as pair:
        r = drive(pair, "agent-scaler", f"sqlite:///{tmp_path / 'tide.db'}")
    # The agent's transport: keepalive time + timeout + 1 s (T06's bound).
    assert r["agent_detect_s"] <= drv.KEEPALIVE_TIME_S + drv.KEEPALIVE_TIMEOUT_S + 1.0, r
    assert r["agent_reason"].startswith("UNAVAILABLE"), r
    # The scaler's side: the stream idle timeout (1 to 1.25 of it) + 1 s.
    assert r["scaler_detect_s"] <= drv.STREAM_IDLE_TIMEOUT_S * 1.25 + 1.0, r
    assert r["node_stale_s"] <= drv.STALE_AFTER_S + 2.0, r
    # Back within the agent's largest backoff + 2 s, nothing lost on the way.
    assert r["agent_reconnect_s"] <= drv.BACKOFF_MAX_S + 2.0, r
    assert r["seq_gaps"] == 0 and r["reports_accepted_across"] > 0, r
    assert r["too_many_pings"] == 0, r


def test_a_decision_across_a_scaler_coordinator_partition_is_applied_once_after_the_heal(
    tmp_path: Path,
) -> None:
    with netns_pair("sc") as pair:
        r = drive(pair, "scaler-coordinator", f"sqlite:///{tmp_path / 'tide.db'}")
    # The Resize call on the cut link fails within the keepalive timeout + 1 s...
    assert r["scaler_detect_s"] <= drv.COORDINATOR_KEEPALIVE_TIMEOUT_S + 1.0, r
    # ...the decision waits (committed, not final) while the link is down...
    assert r["state_during"] in ("DECISION_STATE_PREPARING", "DECISION_STATE_ACTUATING"), r
    # ...and is carried out exactly once after the heal: one replica change, one new
    # generation, one COMPLETED.
    assert r["final_state"] == "DECISION_STATE_COMPLETED" and r["to_replicas"] == 3, r
    assert r["actuator_changes"] == [[2, 3]], r
    assert r["generations_opened"] == 1 and r["completed_events"] == 1, r


def test_launchers_cut_from_the_coordinator_keep_their_membership_and_rendezvous_once(
    tmp_path: Path,
) -> None:
    with netns_pair("lc") as pair:
        r = drive(pair, "launcher-coordinator", f"sqlite:///{tmp_path / 'coordinator.db'}")
    # Each launcher's calls fail within its call deadline + one heartbeat period + 2 s
    # (three launchers on one event loop, on a loaded machine).
    assert r["launcher_detect_s"] <= FAKE_CALL_TIMEOUT_S + HEARTBEAT_S + 2.0, r
    # Unreachable is not lost: nobody is dropped while the link is down...
    assert r["generation_during"] == 1 and r["members_during"] == 3, r
    # ...and the grow asked meanwhile completes after the heal, once: one new generation,
    # one rendezvous per launcher for it, no member registered anew, no step lost.
    assert r["final_phase"] == "RESIZE_PHASE_COMPLETED", r
    assert (r["generation_after"], r["world_size_after"], r["lost_steps_total"]) == (2, 3, 0), r
    for launcher in r["launchers"]:
        assert launcher["rendezvous"].count(2) == 1 and len(launcher["member_ids"]) == 1, r


def test_a_decision_across_a_scaler_apiserver_partition_waits_and_is_applied_once(
    tmp_path: Path,
) -> None:
    with netns_pair("sa") as pair:
        r = drive(pair, "scaler-apiserver", f"sqlite:///{tmp_path / 'tide.db'}")
    # A call on the cut link ends, Unavailable, within its timeout (urllib3 tries an
    # idempotent read up to 4 times) + 1 s: no call hangs.
    assert r["read_error"].startswith("job default/cut: Kubernetes API unreachable"), r
    assert r["read_s"] <= 4 * drv.API_REQUEST_TIMEOUT_S + 1.0, r
    # The decision waits, committed and not final, while the API server is away...
    assert r["state_during"] in ("PREPARING", "ACTUATING"), r
    # ...and after the heal the PaddleJob is patched once, to the decided size.
    assert r["final_state"] == "COMPLETED" and r["replicas"] == 3, r
    assert r["patches"] == 1, r
