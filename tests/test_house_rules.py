"""The house's rules that a linter does not check: no hand-written module over 600 lines (a
module that grows past it is split by what changes together; README.md, "The two commands")."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 600
# Written by protoc (scripts/gen_protos.py), not by hand.
GENERATED = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def test_no_hand_written_module_is_over_600_lines() -> None:
    too_long = {}
    for top in ("tide", "bench", "scripts", "tests"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name.endswith(GENERATED):
                continue
            lines = path.read_text(encoding="utf-8").count("\n")
            if lines > MAX_LINES:
                too_long[str(path.relative_to(ROOT))] = lines
    assert not too_long, f"over {MAX_LINES} lines (split them by what changes together): {too_long}"
