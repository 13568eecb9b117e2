"""The guard's pure parts: identities, rules, requested_by, token identities, the edge
validator, client credentials."""

from __future__ import annotations

import math
import os

import pytest

from tide.base.credentials import ClientCredentials
from tide.base.errors import ConfigError, InvalidArgument, PermissionDenied
from tide.services.common.guard import (
    ANONYMOUS,
    Identity,
    Kind,
    Review,
    Role,
    Rule,
    Subject,
    check_subject,
    identity_from_review,
    identity_from_spiffe,
    requested_by,
)
from tide.services.common.validate import validate_message
from tide.v1 import coordinator_pb2, scaler_pb2, telemetry_pb2

pytestmark = pytest.mark.unit

BASE = "spiffe://tide/ns/tide/sa/tide-x"


@pytest.mark.parametrize(
    ("uri", "kind", "fields"),
    [
        (BASE + "/node/gpu-1", Kind.AGENT, {"node": "gpu-1"}),
        (
            "spiffe://tide/ns/ml/sa/t/job/bert/pod/bert-worker-0",
            Kind.LAUNCHER,
            {"job": "ml/bert", "pod": "bert-worker-0"},
        ),
        (BASE + "/scaler", Kind.SCALER, {}),
        (BASE + "/user/ada/role/operator", Kind.USER, {"role": Role.OPERATOR}),
    ],
)
def test_spiffe_ids_name_each_identity(uri: str, kind: Kind, fields: dict[str, object]) -> None:
    who = identity_from_spiffe(uri)
    assert who is not None and who.kind is kind and who.name == uri
    for k, v in fields.items():
        assert getattr(who, k) == v


@pytest.mark.parametrize(
    "uri",
    [
        "spiffe://other/ns/a/sa/b/node/n",
        BASE + "/node",
        BASE + "/user/ada/role/root",
        BASE + "/job/x/pod",
        "spiffe://tide/ns//sa/b/scaler",
        "https://tide/ns/a/sa/b/scaler",
    ],
)
def test_anything_else_is_no_identity(uri: str) -> None:
    assert identity_from_spiffe(uri) is None


def test_rules_by_kind_and_role() -> None:
    agent = Identity(Kind.AGENT, "a", node="n")
    viewer = Identity(Kind.USER, "v", Role.VIEWER)
    admin = Identity(Kind.USER, "ad", Role.ADMIN)
    telemetry = Rule(frozenset({Kind.AGENT}))
    operate = Rule(role=Role.OPERATOR)
    assert telemetry.allows(agent) and not telemetry.allows(admin)
    assert not operate.allows(viewer) and operate.allows(admin) and not operate.allows(agent)
    assert operate.allows(ANONYMOUS) and telemetry.allows(ANONYMOUS)
    guarded = Identity(Kind.ANONYMOUS, "anonymous", Role.VIEWER)
    assert not operate.allows(guarded) and Rule(role=Role.VIEWER).allows(guarded)


def test_subjects_bind_agents_to_nodes_and_launchers_to_pods() -> None:
    agent = Identity(Kind.AGENT, "a", node="n1")
    launcher = Identity(Kind.LAUNCHER, "l", job="ns/j", pod="j-worker-0")
    check_subject(agent, Subject(node="n1"))
    check_subject(launcher, Subject(job="ns/j", pod="j-worker-0"))
    check_subject(launcher, Subject())  # an unknown member is nobody's
    for who, subject in (
        (agent, Subject(node="n2")),
        (launcher, Subject(job="ns/k", pod="j-worker-0")),
        (launcher, Subject(job="ns/j", pod="j-worker-1")),
    ):
        with pytest.raises(PermissionDenied):
            check_subject(who, subject)


def test_requested_by_is_the_caller_unless_an_admin_names_someone() -> None:
    op = Identity(Kind.USER, "spiffe://tide/ns/a/sa/b/user/otto/role/operator", Role.OPERATOR)
    admin = Identity(Kind.USER, "admin-token", Role.ADMIN)
    assert requested_by(op, "someone-else") == op.name
    assert requested_by(op, "") == op.name
    assert requested_by(admin, "bob") == "bob"
    assert requested_by(admin, "") == "admin-token"
    assert requested_by(ANONYMOUS, "bob") == "bob"
    assert requested_by(ANONYMOUS, "") == "anonymous"


def test_token_identities_from_the_review() -> None:
    kinds = {"tide/agent": "agent", "ml/l": "launcher", "tide/s": "scaler", "ml/ci": "viewer"}
    user = "system:serviceaccount:"
    agent = identity_from_review(Review(True, user + "tide:agent", node="n1"), kinds)
    assert (agent.kind, agent.node) == (Kind.AGENT, "n1")
    launcher = identity_from_review(Review(True, user + "ml:l", pod="bert-worker-3"), kinds)
    assert (launcher.kind, launcher.job, launcher.pod) == (
        Kind.LAUNCHER,
        "ml/bert",
        "bert-worker-3",
    )
    assert identity_from_review(Review(True, user + "tide:s"), kinds).kind is Kind.SCALER
    assert identity_from_review(Review(True, user + "ml:ci"), kinds).role is Role.VIEWER
    for review in (
        Review(True, user + "tide:agent"),  # no node
        Review(True, user + "ml:l", pod="lonely"),  # not a job's pod
        Review(True, user + "ml:other"),
        Review(True, "alice"),
    ):
        with pytest.raises(PermissionDenied):
            identity_from_review(review, kinds)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        (
            telemetry_pb2.NodeReport(gpus=[telemetry_pb2.GpuSample(utilization_pct=math.nan)]),
            "gpus[0].utilization_pct",
        ),
        (telemetry_pb2.NodeReport(gpus=[telemetry_pb2.GpuSample(power_w=-1.0)]), "gpus[0].power_w"),
        (telemetry_pb2.NodeReport(node_name="a b"), "node_name"),
        (telemetry_pb2.NodeReport(node_name="x" * 300), "node_name"),
        (scaler_pb2.ListDecisionsRequest(job_id="nojob"), "job_id"),
        (scaler_pb2.ListDecisionsRequest(states=[99]), "states[0]"),
        (scaler_pb2.GetDecisionRequest(id=-1), "id"),
        (scaler_pb2.RequestResizeRequest(reason="r" * 5000), "reason"),
        (coordinator_pb2.HeartbeatRequest(samples_per_s=math.inf), "samples_per_s"),
        (coordinator_pb2.ResizeRequest(leaving_pods=["p"] * 5000), "leaving_pods"),
    ],
)
def test_the_validator_names_the_bad_field(msg: object, field: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        validate_message(msg)
    assert str(err.value).startswith(field + ":"), str(err.value)


@pytest.mark.parametrize("seconds", [-62135596801, 253402300800, -(2**62), 2**62])
def test_timestamps_outside_the_well_known_range_are_refused(seconds: int) -> None:
    req = scaler_pb2.ListDecisionsRequest()
    req.since.seconds = seconds
    with pytest.raises(InvalidArgument, match=r"^since\.seconds"):
        validate_message(req)
    ack = coordinator_pb2.AckRequest()
    ack.held_at.nanos = -1
    with pytest.raises(InvalidArgument, match=r"^held_at\.nanos"):
        validate_message(ack)


def test_valid_requests_pass() -> None:
    r = telemetry_pb2.NodeReport(node_name="gpu-node-1.zone_a", boot_id="b", seq=3, gpu_capacity=8)
    r.gpus.add(index=0, uuid="GPU-1", utilization_pct=55.5, temperature_c=-5.0)
    r.sampled_at.GetCurrentTime()
    validate_message(r)
    validate_message(scaler_pb2.ListDecisionsRequest(job_id="ml/bert-large", states=[1, 2]))


def test_client_credentials_check_their_files(tmp_path: os.PathLike[str]) -> None:
    with pytest.raises(ConfigError, match="tls_client_key_file"):
        ClientCredentials(tls_client_cert_file="c")
    with pytest.raises(ConfigError, match="no such file"):
        ClientCredentials(tls_ca_file=f"{tmp_path}/missing.pem")


def test_a_token_file_is_read_again_when_it_changes_and_never_shown(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "token"
    path.write_text("first\n")
    creds = ClientCredentials(token_file=str(path))
    assert creds.token() == "first"
    new = path.with_name("token.new")
    new.write_text("second")
    new.replace(path)
    assert creds.token() == "second"
    # The token file that has just read the token shows it in neither repr.
    assert "second" not in repr(creds) and "second" not in repr(creds._token)
    path.unlink()
    assert creds.token() == "second"  # a Secret mid-swap: keep the last one
