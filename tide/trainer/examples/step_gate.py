"""A test-only knob of the example scripts: ``--test-step-gate FILE``. Not for training.

An end-to-end test resizes, kills or drains a job while it trains a fixed step budget; on
a fast or a loaded machine the budget could run out before the test's event landed, and
pacing the steps by time (``--step-delay-s``) cannot promise otherwise. With a gate the
test grants steps instead: ``FILE`` holds the last step the job may train (written whole by
an atomic rename, tide/services/testing/localjob.py), and after each step a rank waits until it
is granted the next one, so an event the test issues while the job waits there lands
mid-run on any machine.

A generation's first step is never withheld: the coordinator counts a generation as
running once every member has trained a step in it, so a job restored at its last granted
step trains one step past the grant. The wait sits outside the session, between steps: no
rank is inside a collective then, and a rank that reads a newer grant first waits for the
others in the next step's own collectives.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

POLL_S = 0.02


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--test-step-gate",
        default="",
        metavar="FILE",
        help="tests only: wait after each step until FILE grants a later one",
    )


def granted(path: Path) -> int:
    """The last step ``path`` grants; none (0) until the test has written it."""
    try:
        return int(path.read_text())
    except FileNotFoundError:
        return 0


def wait_past(gate: str, step: int) -> None:
    """Return once ``gate`` (if any) grants the step after ``step``."""
    if not gate:
        return
    path = Path(gate)
    while granted(path) <= step:
        time.sleep(POLL_S)
