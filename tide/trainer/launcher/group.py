"""A pod's workers: one :class:`WorkerSupervisor` per local worker (one per GPU), seen by
the launcher core as one worker.

The coordinator's member is the pod; the pod's workers are ranks
``pod_rank * size .. pod_rank * size + size - 1`` of the generation (tide/trainer/devices.py).
Local worker 0 speaks for the pod: its progress (with the samples/s of all local workers
summed), its holds, its checkpoints and its end of training are what the core hears. Its hold
is passed on once every local worker has held too (:class:`PodHolds`): each hands its own
state over (a model-parallel job's workers, each its slice) or writes it before it says Held,
and what the pod's Held sets going (the next generation's start, a drain's exit) would cut a
later worker's short. The others are supervised for their lives only: one that dies unasked
fails the pod, as the loss of any rank breaks the generation's group. Every control message goes to every local
worker (a HOLD or CHECKPOINT to one would do, as the ranks agree on the stop step among
themselves, but RESUME and EXIT must reach each).

A RENDEZVOUS is ready when every local worker is: the core hears one Ready, once all have
their group and have restored.

Each local worker keeps its own prewarmed standby, started with its device pinning already
in its environment, so that a worker that builds its model ahead of time builds it on its
own GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path

from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.launcher.supervisor import WorkerSupervisor
from tide.trainer.messages import Held, Progress, Ready, Resume, ToLauncher, ToWorker
from tide.trainer.spawner import Spawner, WorkerHandle

logger = logging.getLogger(__name__)


class _Shared:
    """One spawner (one zygote) for all local workers; the group closes it, once."""

    def __init__(self, inner: Spawner) -> None:
        self.inner = inner

    async def start(self) -> None:
        await self.inner.start()

    async def wait_ready(self) -> float:
        return await self.inner.wait_ready()

    async def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: str
    ) -> WorkerHandle:
        return await self.inner.spawn(argv, env, cwd, log_path)

    async def close(self) -> None:
        pass


class PodHolds:
    """When a pod of ``size`` workers has held, within one generation: its leader's Held goes
    on once every worker has held at that step or later and answered each directive the
    leader's answers. Not the step alone: a worker already holding answers a directive that
    comes late (a pod told to leave after its ranks stopped on other pods' word) by handing
    over or writing its state again, which takes as long as the first time."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._steps = [0] * size
        self._answered: list[set[str]] = [set() for _ in range(size)]
        self._waiting: list[Held] = []

    def held(self, worker: int, msg: Held) -> list[Held]:
        """Worker ``worker`` said ``msg``: the leader's holds that go on now, in order."""
        self._steps[worker] = max(self._steps[worker], msg.step)
        self._answered[worker].update(msg.directive_ids)
        if worker == 0:
            self._waiting.append(msg)
        done: list[Held] = []
        while self._waiting and self._all_held(self._waiting[0]):
            done.append(self._waiting.pop(0))
        return done

    def resumed(self) -> None:
        """A RESUME went out: a hold still waiting answers a barrier that ended without it,
        and passed on now would say HOLDING of a worker that trains."""
        self._waiting.clear()

    def _all_held(self, lead: Held) -> bool:
        ids = set(lead.directive_ids)
        return all(
            self._steps[j] >= lead.step and ids <= self._answered[j] for j in range(self._size)
        )


class WorkerGroup:
    def __init__(
        self,
        settings: LauncherSettings,
        spawner: Spawner,
        state_dir: Path,
        local_envs: Sequence[Mapping[str, str]],
        may_prewarm: Callable[[], bool],
        on_exit: Callable[[WorkerHandle, int, bool], Awaitable[None]],
        on_message: Callable[[ToLauncher], Awaitable[None]],
        member_id: Callable[[], str] = lambda: "",
    ) -> None:
        # local_envs[i]: what local worker i always has (its device pinning, local rank).
        self.size = len(local_envs)
        self._spawner = spawner
        self._finish_wait_s = settings.finish_wait_s
        self._on_exit = on_exit
        self._on_message = on_message
        shared = _Shared(spawner)
        self._dirs = [
            state_dir if self.size == 1 else state_dir / f"local{i}" for i in range(self.size)
        ]
        self.members = [
            WorkerSupervisor(
                settings,
                shared,
                self._dirs[i],
                may_prewarm,
                on_exit=self._exit_handler(i),
                on_message=self._message_handler(i),
                member_id=member_id,
                extra_env=local_envs[i],
            )
            for i in range(self.size)
        ]
        self._ready: dict[int, Ready] = {}
        self._rates: dict[int, float] = {}
        self._holds = PodHolds(self.size)

    @property
    def leader(self) -> WorkerSupervisor:
        return self.members[0]

    @property
    def spawner(self) -> Spawner:
        return self._spawner

    def standby_ready(self) -> bool:
        return all(m.standby_ready() for m in self.members)

    @property
    def worker(self) -> WorkerHandle | None:
        return self.leader.worker

    @property
    def standby(self) -> WorkerHandle | None:
        return self.leader.standby

    def _exit_handler(self, i: int) -> Callable[[WorkerHandle, int, bool], Awaitable[None]]:
        async def handler(worker: WorkerHandle, code: int, expected: bool) -> None:
            if i == 0:
                await self._on_exit(worker, code, expected)
            elif not expected and code != 0:
                # A follower's death breaks the group: the pod has failed.
                await self._on_exit(worker, code, False)

        return handler

    def _message_handler(self, i: int) -> Callable[[ToLauncher], Awaitable[None]]:
        async def handler(msg: ToLauncher) -> None:
            if isinstance(msg, Ready):
                self._ready[i] = msg
                if len(self._ready) == self.size:
                    # The pod is ready when its slowest worker is.
                    lead = self._ready[0]
                    await self._on_message(
                        dataclasses.replace(
                            lead,
                            group_init_s=max(r.group_init_s for r in self._ready.values()),
                            restore_s=max(r.restore_s for r in self._ready.values()),
                        )
                    )
            elif isinstance(msg, Held):
                if self.members[i].replacing:
                    # The old generation's worker, answering late as it is replaced: none of
                    # the new generation's holds. The leader's still reaches the core.
                    if i == 0:
                        await self._on_message(msg)
                    return
                for held in self._holds.held(i, msg):
                    await self._on_message(held)
            elif isinstance(msg, Progress):
                self._rates[i] = msg.samples_per_s
                if i == 0:
                    total = sum(self._rates.values())
                    await self._on_message(dataclasses.replace(msg, samples_per_s=total))
            elif i == 0:
                await self._on_message(msg)

        return handler

    async def followers_finished(self) -> bool:
        """After the first worker finished training: wait, at most ``finish_wait_s``, for the
        others to exit by themselves (each may still write its slice's final checkpoint or the
        script's files, and the pod's end stops every worker); False when one of them failed
        (its exit, reported, is the pod's)."""
        running = [
            m.worker
            for m in self.members[1:]
            if m.worker is not None and m.worker.returncode is None
        ]
        if running:
            try:
                async with asyncio.timeout(self._finish_wait_s):
                    await asyncio.gather(*(w.wait() for w in running))
            except TimeoutError:
                logger.warning(
                    "%d of the pod's other workers still run %.0fs after its first finished; "
                    "stopping them",
                    sum(w.returncode is None for w in running),
                    self._finish_wait_s,
                )
                return True
        return all(m.worker is None or m.worker.returncode == 0 for m in self.members[1:])

    async def start(self) -> float:
        for d in self._dirs:
            d.mkdir(parents=True, exist_ok=True)
        await asyncio.gather(*(m.control.start() for m in self.members))
        return await self._spawner.wait_ready()

    async def close(self) -> None:
        await asyncio.gather(*(m.close() for m in self.members))
        await self._spawner.close()

    async def ensure_standby(self) -> None:
        await asyncio.gather(*(m.ensure_standby() for m in self.members))

    def ensure_standby_soon(self) -> None:
        for m in self.members:
            m.ensure_standby_soon()

    def send(self, msg: ToWorker) -> None:
        if isinstance(msg, Resume):
            self._holds.resumed()
        for m in self.members:
            m.send(msg)

    def forget_queued(self) -> None:
        for m in self.members:
            m.forget_queued()

    async def start_generation(
        self,
        envs: Sequence[Mapping[str, str]],
        generation: int,
        ranks: Sequence[int],
        prepared: bool = False,
    ) -> tuple[WorkerHandle, bool]:
        """Every local worker of a new generation; returns the leader's and whether it was
        the woken standby. ``prepared``: the standbys formed the generation's group ahead;
        used only if every local worker's did (the group needs all of its ranks)."""
        self._ready.clear()
        self._rates.clear()
        self._holds = PodHolds(self.size)
        prepared = prepared and all(m.prepared_for(generation) for m in self.members)
        started = await asyncio.gather(
            *(
                m.start_generation(env, generation, rank, prepared)
                for m, env, rank in zip(self.members, envs, ranks, strict=True)
            )
        )
        return started[0]

    async def prepare(
        self, envs: Sequence[Mapping[str, str]], generation: int, timeout_s: float
    ) -> float:
        """Every local worker's standby joins ``generation``'s group (overlap mode); returns
        the slowest one's group init, seconds. Nothing is kept prepared if one fails."""
        try:
            done = await asyncio.gather(
                *(
                    m.prepare(env, generation, timeout_s)
                    for m, env in zip(self.members, envs, strict=True)
                )
            )
        except BaseException:
            self.discard_prepared()
            raise
        return max(p.group_init_s for p in done)

    def discard_prepared(self) -> None:
        for m in self.members:
            m.discard_prepared()

    def start_prepared(self, generation: int, envs: Sequence[Mapping[str, str]]) -> None:
        """The standbys prepared for ``generation`` restore now (each its own ``envs``)."""
        if all(m.prepared_for(generation) for m in self.members):
            for m, env in zip(self.members, envs, strict=True):
                m.start_prepared(generation, env)

    def go_prepared(self, generation: int, envs: Sequence[Mapping[str, str]]) -> bool:
        """The started standbys prepared for ``generation`` train once restored (overlap
        mode's commit at the barrier); all local workers or none."""
        if not all(m.prepared_for(generation) for m in self.members):
            return False
        return all(
            [m.go_prepared(generation, env) for m, env in zip(self.members, envs, strict=True)]
        )

    def retire_current(self) -> None:
        for m in self.members:
            m.retire_current()

    def adopted_ended(self, worker: WorkerHandle) -> bool:
        """``worker`` was made current by a RENDEZVOUS after it had ended (overlap mode)."""
        return any(m.adopted_ended is worker for m in self.members)

    def went_ahead_step(self) -> int:
        return max(m.went_ahead_step() for m in self.members)

    def log_path(self, pid: int) -> str | None:
        """The log file of the pod's worker ``pid``, if one of its supervisors knows it."""
        return next((p for m in self.members if (p := m.log_path(pid))), None)

    def expect_exit(self) -> None:
        for m in self.members:
            m.expect_exit()

    def current_alive(self) -> bool:
        return all(m.current_alive() for m in self.members)

    async def stop(self) -> None:
        await asyncio.gather(*(m.stop() for m in self.members))

    def kill(self) -> None:
        for m in self.members:
            m.kill()
