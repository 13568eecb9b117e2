"""What the healthy-run checks count as noise in a local run's logs (tide/services/local/logscan.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tide.base.logs import JsonFormatter, TextFormatter
from tide.services.local.logscan import warnings_in

pytestmark = pytest.mark.unit


def line(fmt: logging.Formatter, level: int, msg: str) -> str:
    return fmt.format(logging.LogRecord("services.x", level, __file__, 1, msg, None, None))


def test_warnings_and_errors_in_either_format_and_tracebacks_count(tmp_path: Path) -> None:
    (tmp_path / "scaler.log").write_text(
        "\n".join(
            [
                line(JsonFormatter(), logging.INFO, "fine"),
                line(JsonFormatter(), logging.WARNING, "member watch broke"),
                "LISTENING grpc=1 metrics=None",
                json.dumps({"level": "ERROR", "msg": "boom"}),
            ]
        )
        + "\n"
    )
    (tmp_path / "job-trainer-0.log").write_text(
        "\n".join(
            [
                line(TextFormatter(), logging.INFO, "joined"),
                line(TextFormatter(), logging.ERROR, "worker 0 exited with 0"),
                # A worker's own output is not Tide's.
                "W1206 04:00:00.000 paddle warning: something deprecated",
                "Traceback (most recent call last):",
            ]
        )
        + "\n"
    )
    (tmp_path / "up.stderr").write_text("scaler did not stop within 15.0 s; killing it\n\n")
    assert warnings_in(tmp_path, every_line=("up.stderr", "absent.stderr")) == [
        "job-trainer-0.log: services.x: worker 0 exited with 0",
        "job-trainer-0.log: Traceback (most recent call last):",
        "scaler.log: member watch broke",
        "scaler.log: boom",
        "up.stderr: scaler did not stop within 15.0 s; killing it",
    ]


def test_a_quiet_run_has_no_findings(tmp_path: Path) -> None:
    (tmp_path / "coordinator.log").write_text(line(JsonFormatter(), logging.INFO, "ok") + "\n")
    (tmp_path / "up.stderr").write_text("")
    assert warnings_in(tmp_path, every_line=("up.stderr",)) == []
