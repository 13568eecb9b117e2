"""The launcher<->worker messages: one wire format, typed at both ends; the launcher's table."""

from __future__ import annotations

import pytest

from tide.base.lifecycle import InvalidTransition
from tide.trainer.launcher.model import LIFECYCLE, DirectiveKind, State
from tide.trainer.launcher.wire import directive_of
from tide.trainer.messages import (
    CheckpointAt,
    CheckpointInfo,
    CheckpointWritten,
    Done,
    Exit,
    Go,
    Held,
    Hello,
    Hold,
    MessageError,
    Prepared,
    Progress,
    Ready,
    Rendezvous,
    Resume,
    Resumed,
    Start,
    decode_to_launcher,
    decode_to_worker,
    encode,
)
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.unit

TO_WORKER = [
    Rendezvous(env={"PADDLE_TRAINER_ID": "1", "TIDE_GENERATION": "3"}),
    Start(env={"TIDE_RESTORE_STEP": "40"}),
    Go(env={"TIDE_RESTART_STARTED_AT": "1.7e9"}),
    CheckpointAt(directive_id="d1", step=40),
    CheckpointAt(directive_id="d9", step=41, leaving=True),
    Hold(directive_id="d2"),
    Resume(directive_id="d3"),
    Exit(),
]
TO_LAUNCHER = [
    Hello(pid=123, generation=2),
    Ready(restored_step=30, generation=2, worker_restart_s=0.01, group_init_s=0.4, restore_s=0.03),
    Prepared(generation=3, group_init_s=0.4),
    Progress(step=31, epoch=1, cursor=64, samples_per_s=900.0, first_step_at=1.7e9),
    Held(step=40, held_at=1.7e9, directive_ids=("d1",), checkpoint=CheckpointInfo(40, "ab", 0.02)),
    Held(step=41, held_at=1.7e9, directive_ids=("h",), checkpoint=None),
    Resumed(step=40),
    CheckpointWritten(step=50, digest="cd", write_s=0.01, periodic=True),
    Done(step=200),
]


@pytest.mark.parametrize("msg", TO_WORKER, ids=lambda m: m.TYPE)
def test_launcher_to_worker_round_trip(msg: object) -> None:
    assert decode_to_worker(encode(msg)) == msg  # type: ignore[arg-type]


@pytest.mark.parametrize("msg", TO_LAUNCHER, ids=lambda m: m.TYPE)
def test_worker_to_launcher_round_trip(msg: object) -> None:
    line = encode(msg)  # type: ignore[arg-type]
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_to_launcher(line) == msg


def test_the_two_directions_are_told_apart() -> None:
    # "checkpoint" is CheckpointAt towards the worker and CheckpointWritten back.
    line = b'{"type": "checkpoint", "step": 7, "directive_id": "d", "digest": "x"}'
    assert decode_to_worker(line) == CheckpointAt(directive_id="d", step=7)
    assert decode_to_launcher(line) == CheckpointWritten(step=7, digest="x")
    with pytest.raises(MessageError, match="unknown message type 'hello'"):
        decode_to_worker(encode(Hello(pid=1)))


@pytest.mark.parametrize(
    "line", [b"not json", b"[1, 2]", b'{"type": "nope"}', b'{"type": "progress", "step": "x"}']
)
def test_bad_lines_raise_message_error(line: bytes) -> None:
    with pytest.raises(MessageError):
        decode_to_launcher(line)


def test_directives_become_plain_values() -> None:
    rdv = pb.Rendezvous(
        generation=3,
        world_size=2,
        rank=1,
        master_endpoint="h:1",
        trainer_endpoints=["h:1", "h:2"],
        restore_step=30,
    )
    d = directive_of(
        pb.Directive(
            directive_id="d9", generation=3, kind=pb.Directive.KIND_RENDEZVOUS, rendezvous=rdv
        )
    )
    assert (d.kind, d.kind_name, d.generation) == (DirectiveKind.RENDEZVOUS, "KIND_RENDEZVOUS", 3)
    assert d.rendezvous is not None and d.rendezvous.trainer_endpoints == ("h:1", "h:2")
    assert d.rendezvous.rank == 1 and d.rendezvous.restore_step == 30
    unknown = directive_of(pb.Directive(directive_id="d10", kind=99))  # type: ignore[arg-type]
    assert unknown.kind is DirectiveKind.UNKNOWN and unknown.kind_name == "KIND_99"


def test_the_launcher_lifecycle_is_a_transition_table() -> None:
    assert LIFECYCLE.final_states == frozenset({State.DONE})
    assert LIFECYCLE.check(State.RUNNING, State.HOLDING) is State.HOLDING
    with pytest.raises(InvalidTransition, match="RUNNING -> STANDBY"):
        LIFECYCLE.check(State.RUNNING, State.STANDBY)
