"""Tide's WARNING and ERROR lines in a local run's logs (STATE_DIR/logs): a healthy run
has none, teardown included (issue 32). Read from every service's and launcher's log,
in either of tide.base.logs' formats (a JSON object per line with ``level``, or a text
line ``TIME LEVEL logger: message``); a worker's own output (Paddle's warnings among
it) is neither and is not counted. A Python traceback is counted too: it is an error
whichever logger printed it, or none."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Final

LEVELS: Final = frozenset({"WARNING", "ERROR", "CRITICAL"})

# tide.base.logs.TextFormatter: RFC 3339 time in UTC with milliseconds, then the level.
_TEXT: Final = re.compile(r"^\d{4}-\d\d-\d\dT[\d:.]+Z (?P<level>[A-Z]+) (?P<msg>.*)$")


def _finding(raw: str) -> str | None:
    """The message of ``raw`` when it is a Tide WARNING/ERROR line or a traceback."""
    if raw.startswith("{"):
        try:
            doc = json.loads(raw)
        except ValueError:
            return None
        if isinstance(doc, dict) and doc.get("level") in LEVELS:
            return str(doc.get("msg"))
        return None
    m = _TEXT.match(raw)
    if m is not None:
        return m["msg"] if m["level"] in LEVELS else None
    if raw.startswith("Traceback (most recent call last)"):
        return raw
    return None


def warnings_in(logs: Path, *, every_line: tuple[str, ...] = ()) -> list[str]:
    """``FILE: message`` of each WARNING or ERROR line of ``logs/*.log``, in file order.

    Files named in ``every_line`` (under ``logs``) should be empty in a healthy run: a
    process's stderr with no log handler of its own (Python's last-resort handler
    prints WARNING and above as the bare message); each of their lines is a finding."""
    found = []
    for f in sorted(logs.glob("*.log")):
        for raw in f.read_text(errors="replace").splitlines():
            msg = _finding(raw)
            if msg is not None:
                found.append(f"{f.name}: {msg}")
    for name in every_line:
        path = logs / name
        if path.exists():
            found += [f"{name}: {line}" for line in path.read_text().splitlines() if line.strip()]
    return found
