"""Write docs/api.md from tide/v1/*.proto, or check it (``--check``, as the tests do).

The protos' comments are the API's documentation; this turns them into one
reference page, with a grpcurl example for each Scaler call and a Python client
example, so the page cannot drift from the API. Each grpcurl example's request
is parsed into its request message here: an example that names a field the API
does not have fails the generation.

    python scripts/gen_api_docs.py [--check]     (make proto runs it too)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, json_format
from google.protobuf.descriptor_pool import DescriptorPool
from google.protobuf.message_factory import GetMessageClass
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO = ROOT
OUT = ROOT / "docs" / "api.md"
PACKAGE = "tide.v1"

#: The calls that change something (operator or admin role; the examples send the admin
#: token); who may call what is RULES in tide/services/scaler/servicer.py and rules() in
#: tide/services/coordinator/servicer.py (docs/security.md).
ADMIN = {
    "Scaler": {"UpsertJob", "RequestResize", "SetAutoscaling"},
    "Coordinator": {"Resize", "AbortResize"},
}

#: One grpcurl request per Scaler call (JSON, the proto's field names).
SCALER_EXAMPLES: dict[str, dict[str, object]] = {
    "ListJobs": {},
    "GetJob": {"job_id": "ml/resnet"},
    "UpsertJob": {
        "job_id": "ml/resnet",
        "initial_replicas": 2,
        "gpus_per_replica": 1,
        "policy": {"min_replicas": 2, "max_replicas": 8, "cooldown_s": 600},
    },
    "ListDecisions": {
        "job_id": "ml/resnet",
        "since": "2026-12-01T00:00:00Z",
        "states": ["DECISION_STATE_FAILED"],
        "page_size": 50,
    },
    "GetDecision": {"id": 42, "context_minutes": 15},
    "RequestResize": {
        "job_id": "ml/resnet",
        "replicas": 4,
        "reason": "INC-123: more throughput",
        "requested_by": "alice",
    },
    "SetAutoscaling": {"job_id": "ml/resnet", "paused": True, "reason": "INC-123"},
    "WatchDecisions": {"job_id": "ml/resnet"},
    "ListUtilization": {
        "job_id": "ml/resnet",
        "since": "2026-12-02T00:00:00Z",
        "until": "2026-12-03T00:00:00Z",
    },
}

PYTHON_EXAMPLE = '''\
"""List the jobs, then follow one job's decisions (Ctrl-C to stop)."""

import asyncio
import os

import grpc
from tide.v1 import scaler_pb2, scaler_pb2_grpc  # the tide package: pip install .


async def main() -> None:
    target = os.environ.get("TIDE_SCALER", "127.0.0.1:50051")
    async with grpc.aio.insecure_channel(target) as channel:
        scaler = scaler_pb2_grpc.ScalerStub(channel)
        jobs = await scaler.ListJobs(scaler_pb2.ListJobsRequest(), timeout=5)
        for job in jobs.jobs:
            mean = job.window.mean_pct if job.window.HasField("mean_pct") else None
            print(job.job_id, job.current_replicas, "replicas, utilization", mean)
        if not jobs.jobs:
            return
        # A stream: no deadline. Every state change of the job's decisions from now on.
        job_id = jobs.jobs[0].job_id
        watch = scaler.WatchDecisions(scaler_pb2.WatchDecisionsRequest(job_id=job_id))
        await watch.initial_metadata()  # the scaler has subscribed: nothing after is missed
        print("watching", job_id)
        async for event in watch:
            d = event.decision
            print(d.id, d.from_replicas, "->", d.to_replicas, event.state, event.detail)


asyncio.run(main())
'''


def descriptors() -> descriptor_pb2.FileDescriptorSet:
    sources = sorted(str(p.relative_to(PROTO)) for p in (PROTO / "tide" / "v1").glob("*.proto"))
    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO}",
            f"-I{include}",
            "--include_source_info",
            "--include_imports",
            f"--descriptor_set_out={out}",
            *sources,
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        fds = descriptor_pb2.FileDescriptorSet()
        fds.ParseFromString(out.read_bytes())
    return fds


def _comment(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines()]
    return " ".join(line for line in lines if line)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


class Comments:
    def __init__(self, f: descriptor_pb2.FileDescriptorProto) -> None:
        self._by_path = {
            tuple(loc.path): _comment(loc.leading_comments)
            for loc in f.source_code_info.location
            if loc.leading_comments
        }

    def get(self, *path: int) -> str:
        return self._by_path.get(path, "")


def _type_name(field: descriptor_pb2.FieldDescriptorProto) -> str:
    t = descriptor_pb2.FieldDescriptorProto
    if field.type in (t.TYPE_MESSAGE, t.TYPE_ENUM):
        name = field.type_name.lstrip(".")
        short = name.removeprefix(PACKAGE + ".")
        typ = f"[{short}](#{short.lower()})" if short != name else f"`{name}`"
    else:
        typ = f"`{t.Type.Name(field.type).removeprefix('TYPE_').lower()}`"
    if field.label == t.LABEL_REPEATED:
        return f"repeated {typ}"
    if field.proto3_optional:
        return f"optional {typ}"
    return typ


def _grpcurl(service: str, method: str, body: dict[str, object], admin: bool) -> str:
    auth = ' -H "authorization: Bearer $TIDE_ADMIN_TOKEN"' if admin else ""
    data = f" -d '{json.dumps(body)}'" if body else ""
    return f"grpcurl -plaintext{auth}{data} 127.0.0.1:50051 {PACKAGE}.{service}/{method}"


def _check_example(pool: DescriptorPool, request_type: str, body: dict[str, object]) -> None:
    cls = GetMessageClass(pool.FindMessageTypeByName(request_type.lstrip(".")))
    json_format.ParseDict(body, cls())  # raises on a field or value the API does not have


def render(fds: descriptor_pb2.FileDescriptorSet) -> str:
    pool = DescriptorPool()
    for f in fds.file:
        pool.Add(f)
    files = [f for f in fds.file if f.package == PACKAGE]
    out = [
        "# The Tide API (`tide.v1`)",
        "",
        "<!-- Generated by scripts/gen_api_docs.py from tide/v1/*.proto (`make proto`);"
        " tests/docs/test_api_docs.py fails when it differs. Edit the protos' comments. -->",
        "",
        "Every Tide service speaks gRPC and serves reflection and the standard health service,",
        "so `grpcurl` needs no .proto files. Every call is authenticated (docs/security.md):",
        "a client certificate naming a Tide identity (`grpcurl -cacert ca.pem -cert me.pem",
        "-key me-key.pem`), or a bearer token (`-H 'authorization: Bearer <token>'`: the",
        "admin token, or a ServiceAccount token). The Scaler API has viewer (reads, watches),",
        "operator (RequestResize, SetAutoscaling) and admin (UpsertJob) roles. The examples",
        "below are for a server run `--insecure` with an admin token (`-plaintext`). Errors",
        "are gRPC status codes with a message naming the field (INVALID_ARGUMENT), or",
        "NOT_FOUND, FAILED_PRECONDITION, UNAUTHENTICATED, PERMISSION_DENIED, UNAVAILABLE.",
        "Times are `google.protobuf.Timestamp` (RFC 3339 in JSON); units are in the field",
        "names (`_s` seconds, `_pct` percent 0..100).",
        "",
        "- [Calling the Scaler from Python](#calling-the-scaler-from-python)",
    ]
    order = ("Scaler", "Telemetry", "Coordinator")
    services = sorted(
        ((f, i, s) for f in files for i, s in enumerate(f.service)),
        key=lambda x: order.index(x[2].name) if x[2].name in order else len(order),
    )
    out += [f"- [Service {s.name}](#service-{s.name.lower()})" for _, _, s in services]
    out += ["- [Messages](#messages)", "- [Enums](#enums)", ""]
    out += [
        "## Calling the Scaler from Python",
        "",
        "With the `tide` package installed (`pip install .` in the repository; it ships the",
        "generated `tide.v1` modules). `tests/docs/test_api_docs.py` runs this very code",
        "against a scaler:",
        "",
        "```python",
        PYTHON_EXAMPLE.rstrip(),
        "```",
        "",
    ]
    for f, si, svc in services:
        c = Comments(f)
        out += [f"## Service {svc.name}", "", c.get(6, si), ""]
        if svc.name == "Scaler":
            missing = {m.name for m in svc.method} - set(SCALER_EXAMPLES)
            if missing:
                raise SystemExit(f"no grpcurl example for Scaler {sorted(missing)}")
        for mi, m in enumerate(svc.method):
            req = m.input_type.lstrip(".").removeprefix(PACKAGE + ".")
            resp = m.output_type.lstrip(".").removeprefix(PACKAGE + ".")
            stream_in = "stream " if m.client_streaming else ""
            stream_out = "stream " if m.server_streaming else ""
            admin = m.name in ADMIN.get(svc.name, set())
            out += [
                f"### {svc.name}.{m.name}",
                "",
                f"`rpc {m.name}({stream_in}{req}) returns ({stream_out}{resp})`"
                + (" — **admin**" if admin else ""),
                "",
                f"Request [{req}](#{req.lower()}), response [{resp}](#{resp.lower()}).",
                "",
            ]
            doc = c.get(6, si, 2, mi)
            if doc:
                out += [doc, ""]
            if svc.name == "Scaler":
                body = SCALER_EXAMPLES[m.name]
                _check_example(pool, m.input_type, body)
                out += ["```sh", _grpcurl(svc.name, m.name, body, admin), "```", ""]
    out += ["## Messages", ""]
    for f in files:
        c = Comments(f)
        for i, msg in sorted(enumerate(f.message_type), key=lambda x: x[1].name):
            out += [f"### {msg.name}", ""]
            doc = c.get(4, i)
            if doc:
                out += [doc, ""]
            fields = [(fi, fd) for fi, fd in enumerate(msg.field)]
            if not fields:
                out += ["(no fields)", ""]
                continue
            out += ["| field | number | type | description |", "| --- | --- | --- | --- |"]
            for fi, fd in fields:
                out.append(
                    f"| `{fd.name}` | {fd.number} | {_type_name(fd)} | {_cell(c.get(4, i, 2, fi))} |"
                )
            if msg.reserved_name:
                out += [
                    "",
                    "Removed (reserved): " + ", ".join(f"`{n}`" for n in msg.reserved_name) + ".",
                ]
            out.append("")
    out += ["## Enums", ""]
    for f in files:
        c = Comments(f)
        for i, en in sorted(enumerate(f.enum_type), key=lambda x: x[1].name):
            out += [f"### {en.name}", ""]
            doc = c.get(5, i)
            if doc:
                out += [doc, ""]
            out += ["| value | number | description |", "| --- | --- | --- |"]
            for vi, v in enumerate(en.value):
                out.append(f"| `{v.name}` | {v.number} | {_cell(c.get(5, i, 2, vi))} |")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if docs/api.md is not up to date")
    args = ap.parse_args(argv)
    text = render(descriptors())
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print("docs/api.md differs from the protos: run `make proto`", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
