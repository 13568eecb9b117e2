"""A hostile client, written from the protos: for every method of every Tide service,
requests full of edge values (Hypothesis strategies built from the message
descriptors) and garbage bytes, and for every link each forged or unauthenticated
shape, run against real servers over sockets (tide.services.testing.stack).

What counts:

- malformed: every call must end in a status other than UNKNOWN or INTERNAL (a bad
  request is the client's fault: INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION...);
- forged: every call must be refused (UNAUTHENTICATED, PERMISSION_DENIED, or the TLS
  handshake: UNAVAILABLE) and write nothing;
- afterwards both servers still answer.

tests/security runs it small; ``python -m bench.security`` runs it for a while.
"""

from __future__ import annotations

import datetime
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import hypothesis
from google.protobuf import symbol_database
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tide.services.common.pki import CertificateAuthority, Issued
from tide.services.testing.stack import Stack
from tide.v1 import coordinator_pb2, scaler_pb2, telemetry_pb2

SERVICES = (
    scaler_pb2.DESCRIPTOR.services_by_name["Scaler"],
    telemetry_pb2.DESCRIPTOR.services_by_name["Telemetry"],
    coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"],
)

BAD = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL})
REFUSED = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        # A certificate the server does not trust never gets past the handshake.
        grpc.StatusCode.UNAVAILABLE,
    }
)

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}
_IDS = ("ns/a", "ns/job", "node-a", "job-worker-0", "a", "", "ns/", "/x", "x" * 300)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = [v for v in (lo, hi, 0, 1, -1, 2**31, 2**53) if lo <= v <= hi]
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi))


def _scalar(f: FieldDescriptor) -> st.SearchStrategy[Any]:
    if f.type in _INT_RANGES:
        return _ints(*_INT_RANGES[f.type])
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        edges = [float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 1e308, 5e-324, 101.0]
        if f.type == FieldDescriptor.TYPE_FLOAT:
            return st.one_of(st.sampled_from(edges[:6]), st.floats(width=32))
        return st.one_of(st.sampled_from(edges), st.floats())
    if f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if f.type == FieldDescriptor.TYPE_ENUM:
        assert f.enum_type is not None
        known = sorted(f.enum_type.values_by_number)
        return st.one_of(st.sampled_from(known), _ints(-(2**31), 2**31 - 1))
    if f.type == FieldDescriptor.TYPE_STRING:
        return st.one_of(
            st.sampled_from(_IDS),
            st.text(max_size=40),
            st.text(min_size=5000, max_size=5001, alphabet="ab"),
        )
    if f.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    raise AssertionError(f"no strategy for {f.full_name}")


def message_strategy(desc: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Messages of ``desc`` with any subset of fields set to edge values."""
    cls = symbol_database.Default().GetSymbol(desc.full_name)
    fields: list[tuple[FieldDescriptor, st.SearchStrategy[Any]]] = []
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            assert f.message_type is not None
            if depth >= 3 or f.message_type.GetOptions().map_entry:
                continue
            inner = message_strategy(f.message_type, depth + 1)
        else:
            inner = _scalar(f)
        if f.is_repeated:
            fields.append((f, st.lists(inner, max_size=4)))
        else:
            fields.append((f, inner))

    @st.composite
    def build(draw: Callable[[st.SearchStrategy[Any]], Any]) -> Any:
        msg = cls()
        for f, strategy in fields:
            if not draw(st.booleans()):
                continue
            value = draw(strategy)
            target = getattr(msg, f.name)
            if f.is_repeated:
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    for item in value:
                        target.add().CopyFrom(item)
                else:
                    target.extend(value)
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                target.CopyFrom(value)
            else:
                setattr(msg, f.name, value)
        return msg

    return build()


def generate(desc: Descriptor, n: int, seed: int = 0) -> list[Any]:
    """``n`` messages drawn by Hypothesis, the same for the same ``seed``."""
    out: list[Any] = []

    # derandomize would take its seed from the function, whatever ``seed`` says:
    # each seed gives its own reproducible draw only through hypothesis.seed.
    @hypothesis.seed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(message_strategy(desc))
    def collect(msg: Any) -> None:
        out.append(msg)

    collect()
    return out[:n]


@dataclass
class Tally:
    tried: int = 0
    bad: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def add(self, code: grpc.StatusCode, what: str, bad: bool) -> None:
        self.tried += 1
        self.codes[code.name] += 1
        if bad:
            self.bad += 1
            if len(self.examples) < 10:
                self.examples.append(f"{what}: {code.name}")


def _path(service: Any, method: MethodDescriptor) -> str:
    return f"/{service.full_name}/{method.name}"


def _caller_for(stack: Stack, method: str) -> Issued | None:
    """An identity the guard lets through to the method, so the handler is exercised."""
    ca = stack.ca
    if ca is None:
        return None
    if method.startswith("/tide.v1.Telemetry/"):
        return ca.agent("node-a")
    if method.rpartition("/")[2] in ("Register", "Directives", "Ack", "Heartbeat"):
        return ca.launcher("ns/job", "job-worker-0")
    if method.startswith("/tide.v1.Coordinator/"):
        return ca.scaler()
    return ca.user("hostile", "admin")


async def _call(
    channel: grpc.aio.Channel, method: MethodDescriptor, path: str, payload: Any, raw: bool
) -> grpc.StatusCode:
    ser = None if raw else (lambda m: m.SerializeToString())
    timeout = 0.5 if method.server_streaming else 3.0
    try:
        if method.client_streaming:
            call: Any = channel.stream_stream(
                path, request_serializer=ser, response_deserializer=None
            )
            items = payload if isinstance(payload, list) else [payload]
            responses = call(iter(items), timeout=timeout)
            async for _ in responses:
                pass
        elif method.server_streaming:
            call2: Any = channel.unary_stream(
                path, request_serializer=ser, response_deserializer=None
            )
            async for _ in call2(payload, timeout=timeout):
                pass
        else:
            call3: Any = channel.unary_unary(
                path, request_serializer=ser, response_deserializer=None
            )
            await call3(payload, timeout=timeout)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


async def run_malformed(stack: Stack, per_method: int, *, seed: int = 0) -> Tally:
    """Edge-value requests and garbage bytes to every method; none may end UNKNOWN or
    INTERNAL."""
    tally = Tally()
    rng = random.Random(seed)
    channels: dict[tuple[str, str], grpc.aio.Channel] = {}
    try:
        for service in SERVICES:
            target = (
                stack.coordinator_target if service.name == "Coordinator" else stack.scaler_target
            )
            for method in service.methods:
                path = _path(service, method)
                who = _caller_for(stack, path)
                key = (target, who.cert_file if who else "")
                if key not in channels:
                    channels[key] = stack.channel(target, who)
                ch = channels[key]
                half = max(1, per_method // 2)
                for msg in generate(method.input_type, half, seed):
                    if path.endswith("/Stream") and rng.random() < 0.5:
                        msg.node_name = "node-a"
                    code = await _call(ch, method, path, msg, raw=False)
                    tally.add(code, f"{path} {str(msg)[:120]!r}", code in BAD)
                for _ in range(per_method - half):
                    garbage = rng.randbytes(rng.randint(1, 64))
                    code = await _call(ch, method, path, garbage, raw=True)
                    tally.add(code, f"{path} bytes {garbage[:16]!r}", code in BAD)
    finally:
        for ch in channels.values():
            await ch.close()
    return tally


@dataclass(frozen=True)
class Forged:
    """One forged or unauthenticated call: who presents what, to which method."""

    name: str
    target: str  # "scaler" or "coordinator"
    method: str
    request: Any
    issued: Issued | None  # None: TLS without a client certificate
    ca_file: str = ""  # another CA's file: verify the server against the wrong CA
    token: str = ""


def forged_calls(stack: Stack, directory: Path, member_id: str) -> list[Forged]:
    """Every link's unauthenticated and forged shapes (mTLS stack)."""
    ca = stack.ca
    assert ca is not None
    other = CertificateAuthority.create(directory / "other-ca")
    expired = ca.issue(
        "expired-admin",
        uris=("spiffe://tide/ns/local/sa/tide/user/old/role/admin",),
        not_before=datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=40),
        valid_days=1,
    )
    no_identity = ca.issue("no-identity", uris=("spiffe://elsewhere/x",))
    viewer = ca.user("vera", "viewer")
    operator = ca.user("otto", "operator")
    agent = ca.agent("node-a")
    launcher = ca.launcher("ns/job", "job-worker-1")
    other_job = ca.launcher("ns/other", "other-worker-0")
    s, c, t = "/tide.v1.Scaler/", "/tide.v1.Coordinator/", "/tide.v1.Telemetry/Stream"
    upsert = scaler_pb2.UpsertJobRequest(job_id="ns/forged")
    resize = scaler_pb2.RequestResizeRequest(job_id="ns/a", replicas=3, reason="forged")
    pause = scaler_pb2.SetAutoscalingRequest(job_id="ns/a", paused=True, reason="forged")
    report = telemetry_pb2.NodeReport(node_name="node-b", boot_id="forged", seq=1, gpu_capacity=1)
    report.sampled_at.GetCurrentTime()
    register = coordinator_pb2.RegisterRequest(
        job_id="ns/job", pod_name="job-worker-0", host="h", launcher_id="forged", free_port=1
    )
    heartbeat = coordinator_pb2.HeartbeatRequest(member_id=member_id, generation=1)
    ack = coordinator_pb2.AckRequest(member_id=member_id, directive_id="d", ok=True)
    directives = coordinator_pb2.DirectivesRequest(member_id=member_id)
    cresize = coordinator_pb2.ResizeRequest(decision_id=99, job_id="ns/job", target_world_size=1)
    abort = coordinator_pb2.AbortResizeRequest(decision_id=99, job_id="ns/job", reason="x")
    out: list[Forged] = []
    # No credentials, the wrong CA, an expired certificate, no Tide identity, a bad token:
    # on every link, for a method that writes.
    for target, method, req in (
        ("scaler", s + "UpsertJob", upsert),
        ("scaler", s + "RequestResize", resize),
        ("scaler", t, report),
        ("coordinator", c + "Register", register),
        ("coordinator", c + "Resize", cresize),
    ):
        out += [
            Forged("no certificate", target, method, req, None),
            Forged("other CA", target, method, req, other.user("x", "admin"), other.ca_file),
            Forged("expired", target, method, req, expired),
            Forged("no Tide identity", target, method, req, no_identity),
            Forged("unknown token", target, method, req, viewer, token="not-a-token"),
        ]
    out += [
        # Roles on the Scaler API.
        Forged("viewer scales", "scaler", s + "RequestResize", resize, viewer),
        Forged("viewer pauses", "scaler", s + "SetAutoscaling", pause, viewer),
        Forged("viewer upserts", "scaler", s + "UpsertJob", upsert, viewer),
        Forged("operator upserts", "scaler", s + "UpsertJob", upsert, operator),
        Forged("agent reads jobs", "scaler", s + "ListJobs", scaler_pb2.ListJobsRequest(), agent),
        Forged("agent scales", "scaler", s + "RequestResize", resize, agent),
        Forged("launcher scales", "scaler", s + "RequestResize", resize, launcher),
        # Telemetry: only for one's own node, only agents.
        Forged("agent for another node", "scaler", t, report, agent),
        Forged("user streams telemetry", "scaler", t, report, ca.user("ada", "admin")),
        Forged("launcher streams telemetry", "scaler", t, report, launcher),
        # The coordinator: a launcher only as its own pod of its own job.
        Forged("another pod registers", "coordinator", c + "Register", register, launcher),
        Forged("another job registers", "coordinator", c + "Register", register, other_job),
        Forged("another pod heartbeats", "coordinator", c + "Heartbeat", heartbeat, launcher),
        Forged("another pod acks", "coordinator", c + "Ack", ack, launcher),
        Forged("another pod's directives", "coordinator", c + "Directives", directives, launcher),
        Forged("launcher resizes", "coordinator", c + "Resize", cresize, launcher),
        Forged("launcher aborts", "coordinator", c + "AbortResize", abort, launcher),
        Forged("agent registers", "coordinator", c + "Register", register, agent),
        Forged("viewer resizes", "coordinator", c + "Resize", cresize, viewer),
        Forged("operator aborts", "coordinator", c + "AbortResize", abort, operator),
    ]
    return out


def _method(path: str) -> MethodDescriptor:
    service, _, name = path.lstrip("/").rpartition("/")
    for svc in SERVICES:
        if svc.full_name == service:
            return svc.methods_by_name[name]
    raise KeyError(path)


async def run_forged(stack: Stack, directory: Path) -> Tally:
    """Every forged shape once; each must be refused, and nothing written."""
    from tide.base.client import open_channel
    from tide.base.credentials import ClientCredentials

    ca = stack.ca
    assert ca is not None
    # A real member of ns/job, so "another pod" has something to take over.
    async with stack.channel(stack.coordinator_target, ca.launcher("ns/job", "job-worker-0")) as ch:
        register_call: Any = ch.unary_unary(
            "/tide.v1.Coordinator/Register",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=coordinator_pb2.RegisterResponse.FromString,
        )
        reg = await register_call(
            coordinator_pb2.RegisterRequest(
                job_id="ns/job", pod_name="job-worker-0", host="h", launcher_id="real", free_port=9
            ),
            timeout=5,
        )
    member_id = reg.member_id
    before = _written(stack)
    tally = Tally()
    for f in forged_calls(stack, directory, member_id):
        target = stack.scaler_target if f.target == "scaler" else stack.coordinator_target
        creds = stack.credentials(f.issued)
        if f.ca_file:
            creds = ClientCredentials(
                tls_ca_file=f.ca_file,
                tls_client_cert_file=creds.tls_client_cert_file,
                tls_client_key_file=creds.tls_client_key_file,
            )
        async with open_channel(target, credentials=creds, own_subchannels=True) as ch:
            method = _method(f.method)
            if f.token:
                code = await _call_with_token(ch, method, f.method, f.request, f.token)
            else:
                code = await _call(ch, method, f.method, f.request, raw=False)
        tally.add(code, f"{f.name} ({f.method})", code not in REFUSED)
    after = _written(stack)
    if after != before:
        tally.bad += 1
        tally.examples.append(f"state changed: {before} -> {after}")
    return tally


async def run_refused_streams(stack: Stack, directory: Path, *, tries: int, messages: int) -> Tally:
    """Each forged shape that reaches the guard on the telemetry stream, ``tries`` times,
    its client writing ``messages`` reports back to back before it half-closes. Each
    must end with its refusal's own code: the guard reads a refused stream to its
    half-close before refusing (``refused_streams.drain``), so no write is in flight to turn the
    status into grpcio's INTERNAL "Internal error from Core" (grpc/grpc#36066)."""
    from tide.base.client import open_channel

    expected = {
        "unknown token": grpc.StatusCode.UNAUTHENTICATED,
        "no Tide identity": grpc.StatusCode.PERMISSION_DENIED,
        "agent for another node": grpc.StatusCode.PERMISSION_DENIED,
        "user streams telemetry": grpc.StatusCode.PERMISSION_DENIED,
        "launcher streams telemetry": grpc.StatusCode.PERMISSION_DENIED,
    }
    shapes = [f for f in forged_calls(stack, directory, "") if f.method.endswith("/Stream")]
    before = _written(stack)
    tally = Tally()
    for f in shapes:
        want = expected.get(f.name)
        if want is None:
            continue  # refused in the TLS handshake: no stream to race
        method = _method(f.method)
        creds = stack.credentials(f.issued)
        async with open_channel(stack.scaler_target, credentials=creds, own_subchannels=True) as ch:
            for _ in range(tries):
                code = await _call_with_token(ch, method, f.method, f.request, f.token, messages)
                tally.add(code, f"{f.name} ({f.method})", code is not want)
    if _written(stack) != before:
        tally.bad += 1
        tally.examples.append("state changed")
    return tally


async def _call_with_token(
    channel: grpc.aio.Channel,
    method: MethodDescriptor,
    path: str,
    request: Any,
    token: str,
    copies: int = 1,
) -> grpc.StatusCode:
    md = (("authorization", f"Bearer {token}"),) if token else ()
    ser = lambda m: m.SerializeToString()  # noqa: E731
    try:
        if method.client_streaming:
            stream: Any = channel.stream_stream(path, request_serializer=ser)
            call: Any = stream(iter([request] * copies), metadata=md)
            async for _ in call:
                pass
        elif method.server_streaming:
            async for _ in channel.unary_stream(path, request_serializer=ser)(
                request, metadata=md, timeout=0.5
            ):
                pass
        else:
            await channel.unary_unary(path, request_serializer=ser)(request, metadata=md, timeout=3)
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _written(stack: Stack) -> tuple[Any, ...]:
    """What a forged call could have changed."""
    members = {
        job: sorted((m.pod_name, m.launcher_id, m.state.name) for m in rt.members.values())
        for job, rt in stack.coord.jobs.items()
    }
    resizes = {job: sorted(rt.resizes) for job, rt in stack.coord.jobs.items()}
    jobs = {j: (r.current_replicas, r.autoscaling_paused) for j, r in stack.core.jobs.items()}
    nodes = sorted(stack.core.ingest.nodes)
    return (members, resizes, jobs, nodes, stack.core.ingest.reports_accepted)


async def servers_alive(stack: Stack, issued: Issued | None = None) -> bool:
    """Both servers answer health and a real call."""
    who = issued or (stack.ca.user("probe", "viewer") if stack.ca else None)
    try:
        for target in (stack.scaler_target, stack.coordinator_target):
            async with stack.channel(target, who) as ch:
                health: Any = health_pb2_grpc.HealthStub(ch)
                got = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                if got.status != health_pb2.HealthCheckResponse.SERVING:
                    return False
        async with stack.channel(stack.scaler_target, who) as ch:
            list_jobs: Any = ch.unary_unary("/tide.v1.Scaler/ListJobs")
            await list_jobs(b"", timeout=5)
    except grpc.aio.AioRpcError:
        return False
    return True


def summary(t: Tally) -> dict[str, Any]:
    return {"tried": t.tried, "bad": t.bad, "codes": dict(t.codes), "examples": t.examples}


__all__: Sequence[str] = (
    "Forged",
    "Tally",
    "forged_calls",
    "generate",
    "message_strategy",
    "run_forged",
    "run_malformed",
    "run_refused_streams",
    "servers_alive",
)
