"""tide.base: the time conversions, the LISTENING line and lifecycle tables everyone shares."""

from __future__ import annotations

import enum
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from tide.base.client import channel_target
from tide.base.errors import ConfigError, grpc_status_of
from tide.base.lifecycle import InvalidTransition, TransitionTable
from tide.base.listening import Listening, listening_line, parse_listening
from tide.base.timeconv import (
    datetime_of,
    field_datetime,
    field_seconds,
    seconds_of,
    ts_from_datetime,
    ts_from_seconds,
)
from tide.v1 import coordinator_pb2

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("seconds", [0.0, 1.5, 1_800_000_000.123456, -2.25])
def test_seconds_round_trip_to_the_microsecond(seconds: float) -> None:
    ts = ts_from_seconds(seconds)
    assert ts is not None and 0 <= ts.nanos < 1_000_000_000
    assert seconds_of(ts) == pytest.approx(seconds, abs=1e-6)


def test_unknown_times_stay_unknown() -> None:
    assert ts_from_seconds(None) is None
    assert ts_from_seconds(float("nan")) is None
    assert ts_from_datetime(None) is None
    msg = coordinator_pb2.Directive()
    assert field_seconds(msg, "deadline") is None
    assert field_datetime(msg, "deadline") is None


def test_datetimes_are_utc_and_naive_ones_are_taken_as_utc() -> None:
    aware = datetime(2026, 12, 2, 12, 0, 30, 250_000, tzinfo=UTC)
    ts = ts_from_datetime(aware)
    assert ts is not None and datetime_of(ts) == aware
    naive = ts_from_datetime(aware.replace(tzinfo=None))
    assert naive == ts
    msg = coordinator_pb2.Directive()
    msg.deadline.CopyFrom(ts)
    assert field_datetime(msg, "deadline") == aware
    assert field_seconds(msg, "deadline") == pytest.approx(aware.timestamp())


def test_the_listening_line_parses_back() -> None:
    assert parse_listening(listening_line(4321, 9090)) == Listening(4321, 9090)
    assert parse_listening(listening_line(4321, None).encode()) == Listening(4321, None)
    assert parse_listening("LISTENING grpc=7") == Listening(7, None)
    assert parse_listening("starting up") is None


class Light(enum.Enum):
    RED = 1
    GREEN = 2
    OFF = 3


def test_a_table_moves_only_along_its_edges_and_a_wrong_move_is_a_bug() -> None:
    table = TransitionTable(
        "light", {Light.RED: {Light.GREEN, Light.OFF}, Light.GREEN: {Light.RED}, Light.OFF: ()}
    )
    assert table.check(Light.RED, Light.GREEN) is Light.GREEN
    assert table.final_states == {Light.OFF} and table.is_final(Light.OFF)
    assert (Light.GREEN, Light.RED) in table.edges()
    with pytest.raises(InvalidTransition, match=r"light door: OFF -> RED"):
        table.check(Light.OFF, Light.RED, what="door")
    # Not a user's mistake: the gRPC edge answers INTERNAL.
    assert grpc_status_of(InvalidTransition("x")) is grpc.StatusCode.INTERNAL


def test_a_table_must_list_every_state() -> None:
    with pytest.raises(ValueError, match="OFF"):
        TransitionTable("light", {Light.RED: {Light.GREEN}, Light.GREEN: {Light.RED}})


def test_one_address_is_dialled_as_it_is() -> None:
    assert channel_target("coordinator.tide:50051") == ("coordinator.tide:50051", {})


def test_replica_addresses_become_one_health_routed_target() -> None:
    target, options = channel_target("127.0.0.1:5001, 10.0.0.2:5002")
    assert target == "ipv4:127.0.0.1:5001,10.0.0.2:5002"
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": ""}
    assert channel_target("[::1]:5001,[::1]:5002")[0] == "ipv6:[::1]:5001,[::1]:5002"


@pytest.mark.parametrize(
    "bad",
    ["coordinator-0:5001,coordinator-1:5001", "127.0.0.1:5001,127.0.0.1", "127.0.0.1:1,[::1]:2"],
)
def test_a_bad_replica_list_names_the_value(bad: str) -> None:
    with pytest.raises(ConfigError, match="address list"):
        channel_target(bad)


def test_a_calls_own_token_beats_the_token_file(tmp_path: Path) -> None:
    """The token file is a channel's default: an admin call that carries ``--token`` keeps
    it (in the scaler's pod, whose TIDE_TOKEN_FILE is the pod's own token)."""
    from collections import namedtuple

    from tide.base.client import _UnaryUnary
    from tide.base.credentials import ClientCredentials

    token_file = tmp_path / "token"
    token_file.write_text("pod-token\n")
    interceptor = _UnaryUnary(ClientCredentials(token_file=str(token_file)))
    details = namedtuple("details", ["method", "metadata"])

    def authorization(metadata: Any) -> list[str]:
        out = interceptor.details(details("/m", metadata)).metadata
        return [v for k, v in out if k == "authorization"]

    assert authorization(None) == ["Bearer pod-token"]
    assert authorization(grpc.aio.Metadata(("x", "1"))) == ["Bearer pod-token"]
    assert authorization(grpc.aio.Metadata(("authorization", "Bearer admin"))) == ["Bearer admin"]
