"""`tide jobs` of a job the coordinator failed for good: the table and the document say so."""

from __future__ import annotations

import pytest

from tide.services.cli.render import job_doc, jobs_rows
from tide.v1 import scaler_pb2

pytestmark = pytest.mark.unit

WHY = "restart budget spent: the worker was killed by SIGSEGV; its log ends:\nFatal error"


def test_a_failed_job_reads_failed_in_tide_jobs() -> None:
    failed = scaler_pb2.Job(job_id="ml/a", failure=WHY)
    headers, rows = jobs_rows([failed, scaler_pb2.Job(job_id="ml/b")])
    column = headers.index("AUTOSCALING")
    assert rows[0][column] == (
        "off: job FAILED (restart budget spent: the worker was killed by SIGSEGV; its log ends:)"
    )
    assert rows[1][column] == "on"
    assert job_doc(failed)["failure"] == WHY
    assert job_doc(scaler_pb2.Job(job_id="ml/b"))["failure"] is None
