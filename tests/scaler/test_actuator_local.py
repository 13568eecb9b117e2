"""The local actuator with real processes (a fake launcher that records its life)."""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.poll import wait_for
from tests.support.procs import ROOT, gone
from tide.base.errors import ConfigError, InvalidArgument, NotFound
from tide.services.scaler.actuators.local import (
    JobSpec,
    LocalActuator,
    LocalActuatorSettings,
    is_running,
)

pytestmark = pytest.mark.component

FAKE = str(ROOT / "tests" / "local" / "fake_launcher.py")
JOB = "ml/resnet"

Factory = Callable[..., LocalActuator]


@pytest.fixture
def log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "launches.log"
    path.touch()
    monkeypatch.setenv("FAKE_LAUNCHER_LOG", str(path))
    return path


@pytest.fixture
def make(tmp_path: Path, log: Path) -> Iterator[Factory]:
    state = tmp_path / "state"
    made: list[LocalActuator] = []

    def factory(**kw: object) -> LocalActuator:
        settings = LocalActuatorSettings(
            state_dir=state,
            coordinator="127.0.0.1:1",
            launcher=(sys.executable, FAKE),
            **kw,  # type: ignore[arg-type]
        )
        a = LocalActuator(settings)
        made.append(a)
        return a

    yield factory
    # Never leave a process behind, whatever the test did.
    for job in LocalActuator(LocalActuatorSettings(state, "127.0.0.1:1", stop_grace_s=0)).jobs():
        for pod in LocalActuator(LocalActuatorSettings(state, "127.0.0.1:1")).pods(job):
            os.killpg(pod.pid, signal.SIGKILL)
    for a in made:
        for proc in a._children.values():
            proc.wait(10)


def started(log: Path, n: int) -> list[list[str]]:
    def lines() -> list[list[str]] | None:
        got = [ln.split() for ln in log.read_text().splitlines() if ln.startswith("start")]
        return got if len(got) >= n else None

    return wait_for(lines, timeout_s=20, what=f"{n} launcher starts")


def terms(log: Path) -> list[int]:
    return [int(ln.split()[1]) for ln in log.read_text().splitlines() if ln.startswith("term")]


async def test_pods_are_named_indexed_and_set_replicas_is_idempotent(
    make: Factory, log: Path
) -> None:
    a = make()
    a.write_spec(JOB, JobSpec(command=("python", "train.py", "--steps", "9")))
    await a.set_replicas(JOB, 2, decision_id=1)
    lines = started(log, 2)
    assert sorted((ln[1], ln[2]) for ln in lines) == [
        ("0", "resnet-trainer-0"),
        ("1", "resnet-trainer-1"),
    ]
    assert lines[0][5:] == ["python", "train.py", "--steps", "9"]
    pids = [p.pid for p in a.pods(JOB)]
    await a.set_replicas(JOB, 2, decision_id=2)
    assert [p.pid for p in a.pods(JOB)] == pids
    assert len(started(log, 2)) == 2
    assert await a.get_replicas(JOB) == 2
    assert (a.settings.state_dir / "logs" / "resnet-trainer-1.log").exists()


async def test_shrink_stops_the_highest_indexes_first_with_their_workers(
    make: Factory, log: Path
) -> None:
    a = make()
    a.write_spec(JOB, JobSpec(command=("train",)))
    await a.set_replicas(JOB, 4, decision_id=1)
    workers = {int(ln[1]): int(ln[4]) for ln in started(log, 4)}
    await a.set_replicas(JOB, 1, decision_id=2)
    assert terms(log) == [3, 2, 1]
    assert [p.index for p in a.pods(JOB)] == [0]
    assert await a.get_replicas(JOB) == 1
    for index in (1, 2, 3):
        wait_for(lambda i=index: gone(workers[i]), what=f"worker of pod {index} gone")


async def test_remove_pods_stops_exactly_the_named_pod_and_a_grow_fills_its_index(
    make: Factory, log: Path
) -> None:
    """A preempted node's pod is not the highest index: it goes, the others keep running
    (the generation that formed without it), and the gap stays until a grow."""
    a = make()
    a.write_spec(JOB, JobSpec(command=("train",)))
    await a.set_replicas(JOB, 3, decision_id=1)
    started(log, 3)
    pods = {p.index: p for p in a.pods(JOB)}
    assert len({p.uid for p in pods.values()}) == 3 and all(p.uid for p in pods.values())
    await a.remove_pods(JOB, [pods[1].uid], replicas=2, decision_id=2)
    assert terms(log) == [1]
    assert [(p.index, p.pid) for p in a.pods(JOB)] == [(0, pods[0].pid), (2, pods[2].pid)]
    assert await a.get_replicas(JOB) == 2
    # A repeat (a resumed decision), and the count asked again, change nothing.
    await a.remove_pods(JOB, [pods[1].uid], replicas=2, decision_id=2)
    await a.set_replicas(JOB, 2, decision_id=2)
    assert [p.index for p in a.pods(JOB)] == [0, 2] and terms(log) == [1]
    # A restarted actuator keeps the gap; a grow fills the lowest free index.
    b = make()
    await b.set_replicas(JOB, 3, decision_id=3)
    started(log, 4)
    assert [p.index for p in b.pods(JOB)] == [0, 1, 2] and terms(log) == [1]
    # Named by pod name works too; a shrink past the named ones cuts the highest.
    await b.remove_pods(JOB, ["resnet-trainer-0"], replicas=1, decision_id=4)
    assert sorted(terms(log)) == [0, 1, 2] and [p.index for p in b.pods(JOB)] == [1]


async def test_a_named_pod_that_died_before_its_removal_is_not_restarted(
    make: Factory, log: Path
) -> None:
    """A SIGTERMed pod's launcher leaves and exits before the scaler lowers the replicas:
    its pid file is gone. The decision names it by uid and by name (as the controller
    passes them); its index must go: restarted, it took the place of the highest pod, a
    member of the new generation, which was stopped (seen in CI: pod 1 restarted, pod 2
    stopped)."""
    a = make()
    a.write_spec(JOB, JobSpec(command=("train",)))
    await a.set_replicas(JOB, 3, decision_id=1)
    started(log, 3)
    pods = {p.index: p for p in a.pods(JOB)}
    # The whole pod (its process group): the launcher's worker goes with it, as it does
    # when a real launcher leaves; the launcher alone left the worker running past the test.
    os.killpg(pods[1].pid, signal.SIGKILL)
    wait_for(
        lambda: [p.index for p in a.pods(JOB)] == [0, 2] or None, timeout_s=10, what="pod 1 reaped"
    )
    await a.remove_pods(JOB, [pods[1].uid, pods[1].name], replicas=2, decision_id=2)
    assert [(p.index, p.pid) for p in a.pods(JOB)] == [(0, pods[0].pid), (2, pods[2].pid)]
    assert terms(log) == [] and len(started(log, 3)) == 3


async def test_a_restarted_actuator_adopts_the_pods_it_started_before(
    make: Factory, log: Path
) -> None:
    first = make()
    first.write_spec(JOB, JobSpec(command=("train",)))
    await first.set_replicas(JOB, 3, decision_id=1)
    started(log, 3)
    before = {p.index: p.pid for p in first.pods(JOB)}

    second = make()  # the scaler restarted: same state dir, no memory
    assert await second.get_replicas(JOB) == 3
    assert {p.index: p.pid for p in second.pods(JOB)} == before
    await second.set_replicas(JOB, 3, decision_id=2)
    assert len(started(log, 3)) == 3  # nothing new
    await second.set_replicas(JOB, 2, decision_id=3)
    assert terms(log) == [2]
    assert {p.index: p.pid for p in second.pods(JOB)} == {0: before[0], 1: before[1]}


async def test_a_dead_pod_is_started_again(make: Factory, log: Path) -> None:
    a = make()
    a.write_spec(JOB, JobSpec(command=("train",)))
    await a.set_replicas(JOB, 2, decision_id=1)
    started(log, 2)
    dead = a.pods(JOB)[1]
    os.killpg(dead.pid, signal.SIGKILL)
    wait_for(lambda: [p.index for p in a.pods(JOB)] == [0], what="pod 1 seen dead")
    await a.set_replicas(JOB, 2, decision_id=2)
    lines = started(log, 3)
    assert lines[-1][1] == "1" and int(lines[-1][3]) != dead.pid


async def test_a_recycled_pid_is_never_signalled(make: Factory, log: Path) -> None:
    a = make()
    a.write_spec(JOB, JobSpec(command=("train",)))
    await a.set_replicas(JOB, 1, decision_id=1)
    started(log, 1)
    # A pid file left by a pod whose pid now belongs to another process (us).
    stale = a.job_dir(JOB) / "pods" / "1.json"
    stale.write_text(json.dumps({"index": 1, "name": "x", "pid": os.getpid(), "start": 1}))
    assert [p.index for p in a.pods(JOB)] == [0]
    assert not stale.exists()
    await a.set_replicas(JOB, 1, decision_id=2)
    assert terms(log) == []


async def test_a_pod_that_ignores_sigterm_is_killed_after_the_grace(
    make: Factory, log: Path
) -> None:
    a = make(stop_grace_s=0.3)
    a.write_spec(JOB, JobSpec(command=("train",), env={"FAKE_IGNORE_TERM": "1"}))
    await a.set_replicas(JOB, 1, decision_id=1)
    worker = int(started(log, 1)[0][4])
    pod = a.pods(JOB)[0]
    await a.set_replicas(JOB, 0, decision_id=2)
    assert terms(log) == [0]
    assert not is_running(pod.pid, pod.start_ticks)
    # The launcher's group goes with it: no orphaned worker keeps a GPU.
    wait_for(lambda: gone(worker), what="orphaned worker gone")
    assert a.pods(JOB) == []


async def test_stop_all_keeps_the_wanted_count(make: Factory, log: Path) -> None:
    a = make()
    a.write_spec(JOB, JobSpec(command=("train",)))
    await a.set_replicas(JOB, 2, decision_id=1)
    started(log, 2)
    await a.stop_all()
    # Signalled at once (their logs may come in either order).
    assert a.pods(JOB) == [] and sorted(terms(log)) == [0, 1]
    assert await a.get_replicas(JOB) == 2


async def test_free_gpus_counts_every_job(make: Factory, log: Path) -> None:
    a = make(total_gpus=8)
    a.write_spec(JOB, JobSpec(command=("train",), gpus_per_replica=2))
    a.write_spec("ml/other", JobSpec(command=("train",)))
    assert await a.free_gpus() == 8
    await a.set_replicas(JOB, 3, decision_id=1)
    await a.set_replicas("ml/other", 1, decision_id=2)
    assert await a.free_gpus() == 1
    assert await make().free_gpus() is None


async def test_refusals(make: Factory, tmp_path: Path) -> None:
    a = make()
    with pytest.raises(NotFound, match="no local job spec"):
        await a.set_replicas("ml/unknown", 1, decision_id=1)
    a.write_spec(JOB, JobSpec(command=("train",)))
    with pytest.raises(InvalidArgument, match="replicas must be >= 0"):
        await a.set_replicas(JOB, -1, decision_id=1)
    with pytest.raises(InvalidArgument, match="namespace/name"):
        a.job_dir("../etc")
    assert await a.get_replicas("ml/unknown") is None
    with pytest.raises(ConfigError, match="coordinator"):
        LocalActuatorSettings(tmp_path, "nohost")
    with pytest.raises(ConfigError, match="stop_grace_s"):
        LocalActuatorSettings(tmp_path, "h:1", stop_grace_s=-1)
    with pytest.raises(ConfigError, match="command"):
        JobSpec(command=())


async def test_up_nodes_share_the_pods_of_every_job_in_order(make: Factory, log: Path) -> None:
    from tide.services.local.up import _slice_of_pods

    a = make()
    a.write_spec(JOB, JobSpec(command=("train",)))
    a.write_spec("nlp/bert", JobSpec(command=("train",)))
    await a.set_replicas(JOB, 3, decision_id=1)
    await a.set_replicas("nlp/bert", 2, decision_id=2)
    started(log, 5)
    first, second = _slice_of_pods(a, 0, 4)(), _slice_of_pods(a, 1, 4)()
    # Jobs in id order, then pods by index: node 0 takes the first four GPUs.
    assert first == {
        0: ("ml", "resnet-trainer-0"),
        1: ("ml", "resnet-trainer-1"),
        2: ("ml", "resnet-trainer-2"),
        3: ("nlp", "bert-trainer-0"),
    }
    assert second == {0: ("nlp", "bert-trainer-1")}


async def test_one_actuator_at_a_time_changes_a_jobs_pods(make: Factory, log: Path) -> None:
    import asyncio

    holder, waiter = make(), make()  # e.g. a dying scaler and its successor
    holder.write_spec(JOB, JobSpec(command=("train",)))
    async with holder._job_file_lock(JOB):
        task = asyncio.create_task(waiter.set_replicas(JOB, 1, decision_id=1))
        # Nothing may start while the other holds the job: give it time to try.
        await asyncio.sleep(0.3)
        assert not task.done() and waiter.pods(JOB) == []
    await asyncio.wait_for(task, 10)
    assert [p.index for p in waiter.pods(JOB)] == [0]
