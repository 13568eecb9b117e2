"""`tide job apply -f job.yaml`: create or update jobs (the scaler's UpsertJob, admin).

The file holds one UpsertJobRequest per YAML document (``---`` between several),
with the proto's field names (docs/api.md)::

    job_id: ml/resnet
    initial_replicas: 2        # a new job starts at 2 (a JOB_STARTED decision)
    gpus_per_replica: 1
    policy:
      min_replicas: 2
      max_replicas: 8
      cooldown_s: 600

An unknown field or a wrong type is refused before anything is sent (exit 2,
naming it); the scaler validates the values.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from google.protobuf import json_format

from tide.services.cli import render
from tide.services.cli.app import Exit, fail
from tide.services.cli.connection import Connection, connection_options
from tide.services.cli.output import OutputOpt, emit_document
from tide.services.cli.read import output_option
from tide.v1 import scaler_pb2


def load_requests(path: str) -> list[scaler_pb2.UpsertJobRequest]:
    """The UpsertJobRequests of ``path`` (``-`` for stdin), or exit 2 naming the problem."""
    where = "stdin" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        fail(Exit.USAGE, f"-f {where}: cannot read ({exc.strerror})")
    import yaml  # loaded by the one command that reads YAML, not at every start-up

    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        fail(Exit.USAGE, f"-f {where}: not YAML: {exc}")
    if not docs:
        fail(Exit.USAGE, f"-f {where}: no job in it")
    out = []
    for i, doc in enumerate(docs, start=1):
        what = f"-f {where}" + (f" (document {i})" if len(docs) > 1 else "")
        if not isinstance(doc, dict):
            fail(Exit.USAGE, f"{what}: expected a mapping with job_id, policy, ...")
        req = scaler_pb2.UpsertJobRequest()
        try:
            json_format.ParseDict(doc, req)
        except json_format.ParseError as exc:
            fail(Exit.USAGE, f"{what}: {exc}")
        if not req.job_id:
            fail(Exit.USAGE, f"{what}: job_id is required (NAMESPACE/NAME)")
        out.append(req)
    return out


@connection_options(token=True)
def apply_cmd(
    conn: Connection,
    filename: Annotated[
        str, typer.Option("--filename", "-f", help="YAML file of UpsertJobRequests; - for stdin")
    ],
    output: OutputOpt = "",
) -> None:
    """Create or update jobs from a file: bounds, policy overrides, initial replicas."""
    out = output_option(output) if output else None
    requests = load_requests(filename)

    async def go(s: Any) -> list[scaler_pb2.Job]:
        return [await s.upsert_job(r) for r in requests]

    jobs = conn.call(go)
    doc = render.document("tide.jobs", jobs=[render.job_doc(j) for j in jobs])
    if out is not None and emit_document(doc, out):
        return
    for j in jobs:
        start = f", starting (decision {j.active_decision_id})" if j.active_decision_id else ""
        typer.echo(
            f"job {j.job_id} configured: {j.current_replicas} replica(s),"
            f" bounds {j.policy.min_replicas}..{j.policy.max_replicas}{start}"
        )
