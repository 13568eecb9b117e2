"""The launcher against a fake coordinator over a real socket, with a Paddle-free worker."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from tests.support.poll import eventually
from tests.trainer.fake_coordinator import FakeCoordinator
from tests.trainer.launch_rig import make_launcher
from tide.base.errors import ConfigError
from tide.trainer.launch import Launcher, State, parse_args
from tide.trainer.spawner import WorkerHandle, ZygoteSpawner
from tide.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.component


async def test_rendezvous_checkpoint_resume_drain(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    member = coord.members[mid]
    assert member.register.free_port > 0 and member.register.job_id == "ns/job"
    await eventually(lambda: member.heartbeats, 5, what="a standby heartbeat")
    assert member.last is not None and member.last.phase == pb.WORKER_PHASE_IDLE

    await eventually(lambda: launcher.workers.standby is not None, 10, what="a prewarmed worker")
    assert launcher.workers.standby is not None
    prewarmed = launcher.workers.standby.pid
    (rdv,) = coord.rendezvous([mid], restore_step=7)
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    assert coord.ack_of(rdv).ok  # type: ignore[union-attr]
    # The rendezvous woke the worker forked ahead of time instead of starting one.
    assert launcher.workers.worker is not None and launcher.workers.worker.pid == prewarmed
    await eventually(
        lambda: (
            member.last and member.last.phase == pb.WORKER_PHASE_RUNNING and member.last.step > 7
        ),
        5,
        what="running past the restored step",
    )
    hb = member.last
    assert hb is not None and hb.generation == 1 and hb.first_step_at.seconds > 0
    assert hb.startup.restore_s == pytest.approx(0.02)

    target = hb.step + 5
    ckpt = coord.send(mid, kind=pb.Directive.KIND_CHECKPOINT, checkpoint_step=target)
    await eventually(lambda: coord.ack_of(ckpt), 5, what="checkpoint ack")
    ack = coord.ack_of(ckpt)
    assert ack is not None and ack.ok and ack.checkpoint_step == target
    assert ack.checkpoint_digest == "ab" * 32 and ack.held_at.seconds > 0
    await eventually(lambda: launcher.state is State.HOLDING, 5, what="holding")
    held_step = launcher.progress.step

    # A directive re-sent after a reconnect is acked again, not redone.
    member.queue.put_nowait(ckpt)
    await eventually(
        lambda: sum(a.directive_id == ckpt.directive_id for a in member.acks) == 2, 5, what="re-ack"
    )
    assert launcher.state is State.HOLDING and launcher.progress.step == held_step

    resume = coord.send(mid, kind=pb.Directive.KIND_RESUME)
    await eventually(lambda: launcher.progress.step > held_step, 5, what="training after RESUME")
    assert coord.ack_of(resume) is not None

    drain = coord.send(mid, kind=pb.Directive.KIND_DRAIN)
    assert await asyncio.wait_for(run, 10) == 0
    assert coord.ack_of(drain) is not None


async def test_overlap_prepare_forms_the_next_generation_in_the_standby(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    """PREPARE hands g+1 to the standby while the worker trains; the prepared RENDEZVOUS
    after the barrier starts that same process; a plain one discards a prepared standby."""
    coord, port = fake
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    member = coord.members[mid]
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    await eventually(lambda: launcher.workers.standby is not None, 10, what="a new standby")
    standby = launcher.workers.standby
    assert standby is not None

    (prep,) = coord.rendezvous([mid], kind=pb.Directive.KIND_PREPARE)
    await eventually(lambda: coord.ack_of(prep), 10, what="prepare ack")
    assert coord.ack_of(prep).ok  # type: ignore[union-attr]
    assert prep.generation == 1 and prep.rendezvous.generation == 2
    assert launcher.workers.members[0].prepared_for(2)
    step = launcher.progress.step
    await eventually(lambda: launcher.progress.step > step, 5, what="g trains on meanwhile")

    target = launcher.progress.step + 3
    ckpt = coord.send(mid, kind=pb.Directive.KIND_CHECKPOINT, checkpoint_step=target)
    await eventually(lambda: coord.ack_of(ckpt), 5, what="checkpoint ack")
    (go,) = coord.rendezvous([mid], restore_step=target, prepared=True)
    await eventually(lambda: coord.ack_of(go), 10, what="prepared rendezvous ack")
    assert coord.ack_of(go).ok  # type: ignore[union-attr]
    assert launcher.workers.worker is not None and launcher.workers.worker.pid == standby.pid
    await eventually(
        lambda: member.last and member.last.generation == 2 and member.last.step > target,
        5,
        what="g+1 training past the barrier's step",
    )

    # Prepared for 3, then told a plain RENDEZVOUS (a fallback): the prepared one goes.
    await eventually(lambda: launcher.workers.standby is not None, 10, what="a new standby")
    (prep,) = coord.rendezvous([mid], kind=pb.Directive.KIND_PREPARE)
    await eventually(lambda: coord.ack_of(prep), 10, what="prepare ack")
    prepared = launcher.workers.standby
    assert prepared is not None
    (plain,) = coord.rendezvous([mid], restore_step=0)
    await eventually(lambda: coord.ack_of(plain), 10, what="plain rendezvous ack")
    assert launcher.workers.worker is not None and launcher.workers.worker.pid != prepared.pid
    await eventually(lambda: prepared.returncode is not None, 5, what="the prepared one killed")

    drain = coord.send(mid, kind=pb.Directive.KIND_DRAIN)
    assert await asyncio.wait_for(run, 10) == 0
    assert coord.ack_of(drain) is not None


async def test_a_committing_checkpoint_switches_at_the_hold_without_the_rendezvous(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    """A CHECKPOINT carrying g+1's RENDEZVOUS (overlap mode): at its hold at S the prepared
    worker trains on before the coordinator's RENDEZVOUS, which then only confirms it; the
    member keeps reporting its hold in g meanwhile. A failed commit (a plain RENDEZVOUS of a
    recovery instead) reports, as its last word, the steps the switched worker trained."""
    coord, port = fake
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    member = coord.members[mid]
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")

    async def commit() -> tuple[int, int]:
        await eventually(lambda: launcher.workers.standby is not None, 10, what="a standby")
        (prep,) = coord.rendezvous([mid], kind=pb.Directive.KIND_PREPARE, prepared=True)
        await eventually(lambda: coord.ack_of(prep), 10, what="prepare ack")
        standby = launcher.workers.standby
        assert standby is not None and coord.ack_of(prep).ok  # type: ignore[union-attr]
        target = launcher.progress.step + 3
        info = pb.Rendezvous()
        info.CopyFrom(prep.rendezvous)
        info.restore_step = target
        ckpt = coord.send(
            mid, kind=pb.Directive.KIND_CHECKPOINT, checkpoint_step=target, rendezvous=info
        )
        await eventually(lambda: coord.ack_of(ckpt), 5, what="checkpoint ack")
        assert coord.ack_of(ckpt).checkpoint_step == target  # type: ignore[union-attr]
        # No RENDEZVOUS yet, and the prepared worker already trains past S.
        await eventually(
            lambda: launcher.workers.went_ahead_step() > target + 2, 5, what="g+1 trains at once"
        )
        assert launcher.state is State.HOLDING and launcher.generation == prep.generation
        assert member.last is not None and member.last.step == target
        return standby.pid, target

    pid, target = await commit()
    (confirm,) = coord.rendezvous([mid], restore_step=target, prepared=True)
    await eventually(lambda: coord.ack_of(confirm), 10, what="prepared rendezvous ack")
    assert launcher.workers.worker is not None and launcher.workers.worker.pid == pid
    await eventually(
        lambda: member.last and member.last.generation == 2 and member.last.step > target + 2,
        5,
        what="the switched worker's steps reported in g+1",
    )
    assert member.last is not None and member.last.startup.restore_s == pytest.approx(0.02)

    pid, target = await commit()
    ahead = launcher.workers.went_ahead_step()
    (recovery,) = coord.rendezvous([mid], restore_step=target)
    await eventually(lambda: coord.ack_of(recovery), 10, what="recovery rendezvous ack")
    assert launcher.workers.worker is not None and launcher.workers.worker.pid != pid
    assert any(hb.generation == 2 and hb.step >= ahead for hb in member.heartbeats)

    drain = coord.send(mid, kind=pb.Directive.KIND_DRAIN)
    assert await asyncio.wait_for(run, 10) == 0
    assert coord.ack_of(drain) is not None


async def _prepared_for_generation_2(
    coord: FakeCoordinator, port: int, tmp_path: Path
) -> tuple[Launcher, asyncio.Task[int], str, pb.Directive, WorkerHandle]:
    """A running launcher of one member in generation 1, whose standby acked the PREPARE
    of generation 2: the launcher, its run, the member, the PREPARE and that standby."""
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    await eventually(lambda: launcher.workers.standby is not None, 10, what="a standby")
    (prep,) = coord.rendezvous([mid], kind=pb.Directive.KIND_PREPARE, prepared=True)
    await eventually(lambda: coord.ack_of(prep), 10, what="prepare ack")
    standby = launcher.workers.standby
    assert standby is not None and coord.ack_of(prep).ok  # type: ignore[union-attr]
    return launcher, run, mid, prep, standby


async def test_a_committing_checkpoint_that_came_late_switches_at_the_later_hold(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    """The CHECKPOINT of S came after g passed S (a generation's first seconds, its step
    rate not known yet): the worker holds at the next step P > S, where every rank of g
    holds, and the launcher switches there; the coordinator moves the barrier to P."""
    coord, port = fake
    launcher, run, mid, prep, standby = await _prepared_for_generation_2(coord, port, tmp_path)
    await eventually(lambda: launcher.progress.step >= 3, 5, what="g past step 2")
    late = launcher.progress.step - 1
    info = pb.Rendezvous()
    info.CopyFrom(prep.rendezvous)
    info.restore_step = late
    ckpt = coord.send(mid, kind=pb.Directive.KIND_CHECKPOINT, checkpoint_step=late, rendezvous=info)
    await eventually(lambda: coord.ack_of(ckpt), 5, what="checkpoint ack")
    held = coord.ack_of(ckpt).checkpoint_step  # type: ignore[union-attr]
    assert held > late
    await eventually(
        lambda: launcher.workers.went_ahead_step() > held + 2, 5, what="g+1 trains from P"
    )
    assert launcher.state is State.HOLDING
    (confirm,) = coord.rendezvous([mid], restore_step=held, prepared=True)
    await eventually(lambda: coord.ack_of(confirm), 10, what="prepared rendezvous ack")
    assert launcher.workers.worker is not None and launcher.workers.worker.pid == standby.pid
    assert coord.ack_of(confirm).restored_step == held  # type: ignore[union-attr]

    drain = coord.send(mid, kind=pb.Directive.KIND_DRAIN)
    assert await asyncio.wait_for(run, 10) == 0
    assert coord.ack_of(drain) is not None


async def test_a_switched_worker_that_ended_before_the_rendezvous_stays_the_members_worker(
    fake: tuple[FakeCoordinator, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator went away once the barrier committed (killed, then restarted): the
    prepared worker trains g+1 on to the end of the budget and exits 0 before the confirming
    RENDEZVOUS, while the launcher registers again. It is still this member's worker of g+1:
    the RENDEZVOUS takes it as it ended, with what it said (its restore, its steps, its end),
    and the member reports g+1 finished. A fresh worker in its place would join a group whose
    other ranks are gone (tests/e2e/test_elastic.py::
    test_coordinator_killed_mid_resize_ends_in_one_generation[overlap], FAILED in CI)."""
    coord, port = fake
    monkeypatch.setenv("FAKE_MAX_STEPS", "150")
    launcher, run, mid, prep, prepared = await _prepared_for_generation_2(coord, port, tmp_path)
    member = coord.members[mid]
    target = launcher.progress.step + 3
    assert target < 100, "g trained too far before its barrier"
    info = pb.Rendezvous()
    info.CopyFrom(prep.rendezvous)
    info.restore_step = target
    ckpt = coord.send(
        mid, kind=pb.Directive.KIND_CHECKPOINT, checkpoint_step=target, rendezvous=info
    )
    await eventually(lambda: coord.ack_of(ckpt), 5, what="checkpoint ack")
    # The restarted coordinator does not know the member's stream: it registers again.
    coord.forgotten.add(mid)
    await eventually(lambda: member.registrations >= 2, 10, what="re-registration")
    await eventually(lambda: prepared.returncode is not None, 15, what="g+1 at its budget's end")
    assert prepared.returncode == 0
    assert launcher.state is State.HOLDING and launcher.generation == 1

    (confirm,) = coord.rendezvous([mid], restore_step=target, prepared=True)
    assert await asyncio.wait_for(run, 15) == 0
    ack = coord.ack_of(confirm)
    assert ack is not None and ack.ok and ack.restored_step == target, ack
    last = member.heartbeats[-1]
    assert (last.phase, last.generation, last.step) == (pb.WORKER_PHASE_IDLE, 2, 150)
    assert last.first_step_at.seconds > 0
    assert not [hb for hb in member.heartbeats if hb.phase == pb.WORKER_PHASE_FAILED]
    # No other worker ran in g+1.
    worker = launcher.workers.members[0].worker
    assert worker is not None and worker.pid == prepared.pid


async def test_prepare_without_a_prewarmed_standby_is_nacked(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = make_launcher(port, tmp_path, prewarm=False)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    (prep,) = coord.rendezvous([mid], kind=pb.Directive.KIND_PREPARE)
    await eventually(lambda: coord.ack_of(prep), 10, what="prepare nack")
    ack = coord.ack_of(prep)
    assert ack is not None and not ack.ok and "prewarm" in ack.message
    coord.send(mid, kind=pb.Directive.KIND_STOP)
    assert await asyncio.wait_for(run, 10) == 0


async def test_worker_death_is_reported_at_once(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    coord.heartbeat_interval_s = 30.0  # only an immediate report can pass this test
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    assert launcher.workers.worker is not None
    os.kill(launcher.workers.worker.pid, signal.SIGKILL)
    member = coord.members[mid]
    await eventually(
        lambda: member.last and member.last.phase == pb.WORKER_PHASE_FAILED,
        2,
        what="FAILED heartbeat",
    )
    # The launcher stays up and rejoins with a new worker.
    (rdv2,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv2), 10, what="second rendezvous ack")
    assert launcher.state in (State.STARTING, State.RUNNING)
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_heartbeats_report_checkpoints_and_the_finished_budget(
    fake: tuple[FakeCoordinator, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    coord, port = fake
    coord.heartbeat_interval_s = 30.0  # only beats the launcher sends at once show up
    monkeypatch.setenv("FAKE_CKPT_EVERY", "5")
    monkeypatch.setenv("FAKE_MAX_STEPS", "12")
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    assert await asyncio.wait_for(run, 15) == 0  # the budget is done: the launcher exits 0
    assert coord.ack_of(rdv) is not None and coord.ack_of(rdv).ok  # type: ignore[union-attr]
    beats = coord.members[mid].heartbeats
    reported = [(hb.last_checkpoint_step, hb.last_checkpoint_digest) for hb in beats]
    # Each checkpoint is reported as soon as it is written, with its manifest digest.
    assert (5, f"{5:064x}") in reported and (10, f"{10:064x}") in reported
    assert reported.index((5, f"{5:064x}")) < reported.index((10, f"{10:064x}"))
    last = beats[-1]
    assert (last.phase, last.generation, last.step) == (pb.WORKER_PHASE_IDLE, 1, 12)
    assert last.last_checkpoint_step == 10
    assert not [hb for hb in beats if hb.phase == pb.WORKER_PHASE_FAILED]
    # Its stream ended and a duplicate beat was refused, yet it did not register again.
    assert coord.members[mid].registrations == 1 and list(coord.members) == [mid]


async def test_rendezvous_after_a_loss_reports_where_the_old_worker_stopped(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    coord.heartbeat_interval_s = 30.0
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    member = coord.members[mid]
    coord.rendezvous([mid])
    await eventually(lambda: launcher.progress.step >= 10, 10, what="step 10")
    heard = max(hb.step for hb in member.heartbeats)
    await eventually(lambda: launcher.progress.step > heard, 10, what="a step nobody heard of")
    before = len(member.heartbeats)
    # A peer died: the coordinator re-forms while this worker still trains.
    (rdv2,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv2), 10, what="second rendezvous ack")
    last_words = [hb for hb in member.heartbeats[before:] if hb.generation == 1]
    assert len(last_words) == 1 and last_words[0].step > heard
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_a_rendezvous_that_replaces_a_worker_still_starting_is_acked_ok(
    fake: tuple[FakeCoordinator, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A recovery named a peer whose pod was already gone (its silence had not yet run out):
    # this worker hangs forming that group. When the peer's loss re-forms the job, the next
    # RENDEZVOUS kills it (no prewarmed worker to wake) and starts a new one; the killed
    # worker's asked-for exit must not fail the new worker's start, or the member is lost
    # and the job re-forms without it.
    monkeypatch.setenv("FAKE_HANG_IN_GENERATION", "1")
    coord, port = fake
    launcher = make_launcher(port, tmp_path, prewarm=False)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    (rdv1,) = coord.rendezvous([mid])
    await eventually(lambda: launcher.workers.worker is not None, 10, what="worker of gen 1")
    (rdv2,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv2), 10, what="second rendezvous ack")
    ack = coord.ack_of(rdv2)
    assert ack is not None and ack.ok, ack.message if ack else None
    await eventually(lambda: launcher.state is State.RUNNING, 10, what="running in gen 2")
    assert coord.ack_of(rdv1) is None
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_a_worker_that_does_not_start_in_time_is_stopped_before_the_nack(
    fake: tuple[FakeCoordinator, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Left running, a late starter trained in a generation the coordinator had given up,
    # beside the next one: steps done twice.
    monkeypatch.setenv("FAKE_HANG_IN_GENERATION", "1")
    coord, port = fake
    launcher = make_launcher(port, tmp_path, prewarm=False, start_timeout_s=1.0)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 15, what="the rendezvous's ack")
    ack = coord.ack_of(rdv)
    assert ack is not None and not ack.ok and "did not start" in ack.message
    worker = launcher.workers.worker
    assert worker is not None and worker.returncode is not None
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


async def test_a_killed_zygote_is_restarted_and_the_next_rendezvous_works(
    fake: tuple[FakeCoordinator, int], tmp_path: Path
) -> None:
    coord, port = fake
    launcher = make_launcher(port, tmp_path)
    run = asyncio.create_task(launcher.run())
    await eventually(lambda: coord.members, 10, what="registration")
    (mid,) = coord.members
    await eventually(
        lambda: launcher.workers.standby_ready(),
        10,
        what="a prewarmed worker",
    )
    spawner = launcher.workers.spawner
    assert isinstance(spawner, ZygoteSpawner) and launcher.workers.standby is not None
    zygote, standby = spawner.pid, launcher.workers.standby.pid
    assert zygote is not None
    os.kill(zygote, signal.SIGKILL)
    # A new zygote and a new prewarmed worker, without any directive asking for them.
    await eventually(
        lambda: (
            launcher.workers.standby_ready()
            and launcher.workers.standby is not None
            and launcher.workers.standby.pid != standby
        ),
        15,
        what="a new prewarmed worker",
    )
    assert spawner.pid not in (None, zygote)
    (rdv,) = coord.rendezvous([mid])
    await eventually(lambda: coord.ack_of(rdv), 10, what="rendezvous ack")
    assert coord.ack_of(rdv).ok  # type: ignore[union-attr]
    launcher.stop()
    assert await asyncio.wait_for(run, 10) == 0


def test_command_line() -> None:
    s = parse_args(
        ["--coordinator", "h:1", "--job", "a/b", "--pod-index", "2", "--", "python", "t.py", "--x"]
    )
    assert s.command == ("python", "t.py", "--x") and s.pod_index == 2 and s.job_id == "a/b"
    with pytest.raises(ConfigError, match="job"):
        parse_args(["--coordinator", "h:1", "--job", "nope", "--", "python", "t.py"])
    with pytest.raises(ConfigError, match="command"):
        parse_args(["--coordinator", "h:1", "--job", "a/b"])


@pytest.mark.parametrize(
    ("env", "pod", "index", "job"),
    [
        # paddle-operator: the name, and PADDLE_TRAINER_ID, which it sets.
        (
            {"POD_NAME": "resnet-worker-3", "POD_NAMESPACE": "ml", "PADDLE_TRAINER_ID": "3"},
            "resnet-worker-3",
            3,
            "ml/resnet",
        ),
        # Kubeflow: the name alone (the replica-index label may come as TIDE_REPLICA_INDEX).
        (
            {"POD_NAME": "bert-x-worker-12", "POD_NAMESPACE": "nlp"},
            "bert-x-worker-12",
            12,
            "nlp/bert-x",
        ),
        (
            {"POD_NAME": "p", "POD_NAMESPACE": "nlp", "TIDE_REPLICA_INDEX": "4", "TIDE_JOB": "a/b"},
            "p",
            4,
            "a/b",
        ),
        # Explicit settings win.
        (
            {
                "POD_NAME": "r-worker-1",
                "POD_NAMESPACE": "ml",
                "TIDE_POD_INDEX": "7",
                "TIDE_JOB": "x/y",
            },
            "r-worker-1",
            7,
            "x/y",
        ),
    ],
)
def test_a_paddlejob_pod_is_known_from_its_environment(
    env: dict[str, str], pod: str, index: int, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for var in ("POD_NAME", "POD_NAMESPACE", "TIDE_JOB", "TIDE_POD_INDEX", "PADDLE_TRAINER_ID"):
        monkeypatch.delenv(var, raising=False)
    for k, v in {
        **env,
        "TIDE_COORDINATOR": "tide-coordinator.tide.svc:50052",
        "POD_IP": "10.0.0.7",
    }.items():
        monkeypatch.setenv(k, v)
    s = parse_args(["--", "python", "train.py"])
    assert (s.pod_name, s.pod_index, s.job_id) == (pod, index, job)
    assert s.coordinator == "tide-coordinator.tide.svc:50052" and s.host == "10.0.0.7"


def test_without_the_environment_the_coordinator_and_job_are_required(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for var in ("POD_NAME", "POD_NAMESPACE", "TIDE_JOB", "TIDE_COORDINATOR"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--", "python", "train.py"])
    assert "--coordinator" in capsys.readouterr().err
