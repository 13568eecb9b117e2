"""Tide's WARNING and ERROR lines in a local run's logs (STATE_DIR/logs): a healthy run
has none, teardown included (issue 32). Read from the JSON lines (``--log-format
json``) of every service and launcher; a worker's own output (Paddle's warnings among
it) is not Tide's and is not counted."""

from __future__ import annotations

import json
from pathlib import Path


def warnings_in(logs: Path) -> list[str]:
    """``FILE: message`` of each WARNING or ERROR line, in file order."""
    found = []
    for f in sorted(logs.glob("*.log")):
        for raw in f.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("level") in ("WARNING", "ERROR"):
                found.append(f"{f.name}: {doc.get('msg')}")
    return found
