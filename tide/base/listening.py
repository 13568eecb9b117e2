"""The start-up line every Tide process prints once it serves: ``LISTENING grpc=P metrics=M``.

Ports are often 0 (the kernel picks), so whoever starts a service (the local
supervisor, the local job harness, tests and benchmarks) learns the real ports
from this line on the child's stdout. One format, one parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LINE = re.compile(r"LISTENING grpc=(\d+)(?: metrics=(\d+|None))?")


@dataclass(frozen=True)
class Listening:
    grpc_port: int
    metrics_port: int | None


def listening_line(grpc_port: int, metrics_port: int | None) -> str:
    return f"LISTENING grpc={grpc_port} metrics={metrics_port}"


def parse_listening(line: str | bytes) -> Listening | None:
    """The ports announced by ``line``, or None when it is not the LISTENING line."""
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    m = _LINE.search(text)
    if m is None:
        return None
    metrics = m.group(2)
    return Listening(int(m.group(1)), None if metrics in (None, "None") else int(metrics))
