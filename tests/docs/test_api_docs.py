"""docs/api.md is generated from the protos, and its Python example works against a scaler."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tests.support.procs import ROOT, ServiceProcess, start_memory_scaler
from tide.v1 import scaler_pb2, scaler_pb2_grpc

API_MD = ROOT / "docs" / "api.md"


@pytest.mark.unit
def test_api_md_is_what_the_protos_say() -> None:
    r = subprocess.run(
        [sys.executable, "scripts/gen_api_docs.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    text = API_MD.read_text()
    # A grpcurl example for every Scaler call.
    for method in scaler_pb2.DESCRIPTOR.services_by_name["Scaler"].methods:
        assert f"tide.v1.Scaler/{method.name}" in text, method.name


@pytest.fixture
def scaler(tmp_path: Path) -> Iterator[ServiceProcess]:
    svc = start_memory_scaler(f"sqlite:///{tmp_path / 'tide.db'}")
    try:
        yield svc
    finally:
        svc.terminate()


@pytest.mark.integration
def test_the_python_example_lists_jobs_and_follows_decisions(
    scaler: ServiceProcess, tmp_path: Path
) -> None:
    (code,) = re.findall(r"```python\n(.*?)```", API_MD.read_text(), re.S)
    example = tmp_path / "example.py"
    example.write_text(code)
    with grpc.insecure_channel(scaler.target) as ch:
        stub = scaler_pb2_grpc.ScalerStub(ch)
        stub.UpsertJob(scaler_pb2.UpsertJobRequest(job_id="ml/doc"), timeout=10)
        proc = subprocess.Popen(
            [sys.executable, str(example)],
            cwd=ROOT,
            env={**os.environ, "TIDE_SCALER": scaler.target, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()
            assert first.startswith("ml/doc 2 replicas, utilization None"), first + (
                proc.stderr.read() if proc.stderr else ""
            )
            # Once the example says it watches, no change can be missed.
            assert proc.stdout.readline() == "watching ml/doc\n"
            stub.RequestResize(
                scaler_pb2.RequestResizeRequest(job_id="ml/doc", replicas=3, reason="doc"),
                timeout=10,
            )
            lines: list[str] = []
            while not any(" 4 " in line for line in lines):  # DECISION_STATE_COMPLETED = 4
                line = proc.stdout.readline()
                assert line, proc.stderr.read() if proc.stderr else ""
                lines.append(line)
        finally:
            proc.kill()
            proc.wait(timeout=10)
    assert lines[-1].startswith(lines[-1].split()[0] + " 2 -> 3 4")
