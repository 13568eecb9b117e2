"""The launcher: one per pod, stays up while Paddle worker processes come and go.

It registers with the coordinator (STANDBY) and on each directive drives its worker
(docs/resize-protocol.md):

- RENDEZVOUS: the worker of the new generation (the prewarmed one, woken with the
  generation's environment, or a fresh one) replaces the current one; acked once it has
  its process group and has restored.
- CHECKPOINT / HOLD / RESUME: relayed to the worker; acked when it holds (with rank 0's
  checkpoint digest) or at once for RESUME.
- DRAIN: the worker exits cleanly, the launcher acks and exits 0. STOP: kill and exit.

A worker that dies unasked is reported at once with a heartbeat in phase FAILED.

The pieces: :mod:`tide.trainer.launcher.link` (the coordinator, the only gRPC code),
:mod:`tide.trainer.launcher.supervisor` (worker processes) and
:mod:`tide.trainer.launcher.control` (the control socket); this module decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import tempfile
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from tide.base.errors import Unavailable
from tide.trainer import handover
from tide.trainer.devices import (
    Backend,
    WorkerPlace,
    detect,
    gpu_free_mib,
    local_env,
    memory_shortfall,
)
from tide.trainer.distenv import RESTART_STARTED_AT_ENV, RESTORE_STEP_ENV
from tide.trainer.handover import HANDOVER_DIR_ENV
from tide.trainer.launcher.envs import rendezvous_envs
from tide.trainer.launcher.group import WorkerGroup
from tide.trainer.launcher.link import CoordinatorLink
from tide.trainer.launcher.logs import worker_exit
from tide.trainer.launcher.model import (
    LEAVING,
    LIFECYCLE,
    Ack,
    Beat,
    Directive,
    DirectiveKind,
    DurableCheckpoint,
    State,
    WorkerExit,
    WorkerProgress,
)
from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.messages import (
    CheckpointAt,
    CheckpointWritten,
    Done,
    Exit,
    Held,
    Hold,
    Progress,
    Ready,
    Resume,
    Resumed,
    ToLauncher,
)
from tide.trainer.spawner import Spawner, SubprocessSpawner, WorkerHandle, ZygoteSpawner

logger = logging.getLogger(__name__)


class Launcher:
    def __init__(self, settings: LauncherSettings, spawner: Spawner | None = None) -> None:
        self.s = settings
        self.state = State.STANDBY
        self.generation = 0
        self.exit_code = 0
        self.progress = WorkerProgress()
        # The newest checkpoint a worker of this launcher committed durably (rank 0 only):
        # heartbeats report it (named after a loss) with its lag, for the job's status.
        self.checkpoint = DurableCheckpoint()
        # Set by tide/trainer/launcher/leave.py when the pod is told to go.
        self.leave_requested = False
        self.leave_deadline_s = 0.0
        # How the worker that failed ended (exit cause, log tail), until the next starts.
        self.worker_exit: WorkerExit | None = None
        self._state_dir = Path(settings.state_dir or tempfile.mkdtemp(prefix="tide-launcher-"))
        self._handover_dir = handover.own_pod_handover_dir(
            settings.job_id, settings.pod_name or "pod", settings.launcher_id
        )
        self.link = CoordinatorLink(settings, self._beat, on_fatal=self.stop)
        self.devices = detect(Backend.parse(settings.backend), settings.workers_per_pod)
        use_zygote = settings.use_zygote
        if use_zygote and self.devices.backend is Backend.NCCL:
            # A CUDA context does not survive fork, and importing a GPU build of Paddle may
            # create one: GPU workers start as fresh processes (the prewarmed standby still
            # hides the import from the pause).
            logger.info("launcher %s: nccl workers start without the zygote", settings.pod_name)
            use_zygote = False
        self.workers = WorkerGroup(
            settings,
            spawner
            or (ZygoteSpawner(settings.zygote_preload) if use_zygote else SubprocessSpawner()),
            self._state_dir,
            [
                {**local_env(self.devices, i), **self._handover_env()}
                for i in range(self.devices.workers)
            ],
            may_prewarm=lambda: self.state not in LEAVING,
            on_exit=self._on_worker_exit,
            on_message=self._on_worker_message,
            member_id=lambda: self.link.member_id,
        )
        self._worker_done = False
        self._ready: asyncio.Future[Ready] | None = None
        self._handled: dict[str, Ack] = {}
        self._pending_acks: dict[str, Directive] = {}
        self._rendezvous_task: asyncio.Task[None] | None = None
        self._prepare_task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def member_id(self) -> str:
        return self.link.member_id

    def _handover_env(self) -> dict[str, str]:
        """The pod's shared-memory directory where a worker hands its state to the next one
        (tide/trainer/handover.py); none with ``handover`` off."""
        if not self.s.handover:
            return {}
        return {HANDOVER_DIR_ENV: str(self._handover_dir)}

    def _spawn_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _beat(self) -> Beat:
        return Beat(
            generation=self.generation,
            state=self.state,
            progress=dataclasses.replace(self.progress),
            checkpoint=self.checkpoint,
            leave_requested=self.leave_requested,
            leave_deadline_s=self.leave_deadline_s,
            worker_exit=self.worker_exit if self.state is State.FAILED else None,
        )

    # -- lifecycle ----------------------------------------------------------------------------

    def _set_state(self, new: State) -> None:
        LIFECYCLE.check(self.state, new, what=f"of member {self.member_id}")
        if new is not self.state:
            logger.info(
                "launcher %s (job %s, member %s): %s -> %s",
                self.s.pod_name,
                self.s.job_id,
                self.member_id,
                self.state.name,
                new.name,
            )
        self.state = new
        self.link.wake_heartbeat()

    async def run(self) -> int:
        self._state_dir.mkdir(parents=True, exist_ok=True)
        # Register only once warm: the coordinator starts a barrier as soon as the newcomers
        # are STANDBY, and a cold newcomer would put its Paddle import inside the pause.
        warmup_s = await self.workers.start()
        logger.info("launcher %s warm after %.2fs", self.s.pod_name, warmup_s)
        await self.workers.ensure_standby()
        self.link.start()
        self._spawn_task(self._directive_loop(), "handle")
        try:
            await self._stop.wait()
        finally:
            await self._shutdown()
        return self.exit_code

    async def _shutdown(self) -> None:
        tasks = [*self._tasks, *(t for t in (self._rendezvous_task, self._prepare_task) if t)]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()  # the workers are stopped below: that start is over
        await self.link.close()
        await self.workers.close()
        handover.release_pod_handover_dir(self._handover_dir)

    def stop(self, code: int = 0) -> None:
        self.exit_code = code
        self._stop.set()

    async def _ack(self, ack: Ack) -> None:
        self._handled[ack.directive_id] = ack
        await self.link.ack(ack)

    @staticmethod
    def _ack_of(d: Directive, ok: bool = True, message: str = "") -> Ack:
        return Ack(directive_id=d.directive_id, generation=d.generation, ok=ok, message=message)

    # -- directives -----------------------------------------------------------------------

    async def _directive_loop(self) -> None:
        while True:
            d = await self.link.directives.get()
            try:
                await self._on_directive(d)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.exception("member %s failed directive %s", self.member_id, d.directive_id)
                await self._ack(self._ack_of(d, ok=False, message=str(exc)))

    async def _on_directive(self, d: Directive) -> None:
        if d.directive_id in self._handled:
            logger.info("member %s: directive %s again, re-acking", self.member_id, d.directive_id)
            await self.link.ack(self._handled[d.directive_id])
            return
        if d.directive_id in self._pending_acks:
            return
        logger.info(
            "member %s (job %s) got %s %s for generation %d",
            self.member_id,
            self.s.job_id,
            d.kind_name,
            d.directive_id,
            d.generation,
        )
        if d.kind is DirectiveKind.RENDEZVOUS:
            await self._cancel_rendezvous()
            self._rendezvous_task = asyncio.create_task(self._rendezvous(d))
        elif d.kind is DirectiveKind.PREPARE:
            # In the background: the current worker trains on and may get its CHECKPOINT
            # (a fallback) while the standby still forms the group.
            await self._cancel_prepare()
            self._prepare_task = asyncio.create_task(self._prepare(d))
        elif d.kind is DirectiveKind.CHECKPOINT:
            self._pending_acks[d.directive_id] = d
            self.workers.send(
                CheckpointAt(directive_id=d.directive_id, step=d.checkpoint_step, leaving=d.leaving)
            )
            self._fail_pending_if_no_worker()
        elif d.kind is DirectiveKind.HOLD:
            self._pending_acks[d.directive_id] = d
            self.workers.send(Hold(directive_id=d.directive_id))
            self._fail_pending_if_no_worker()
        elif d.kind is DirectiveKind.RESUME:
            self.workers.send(Resume(directive_id=d.directive_id))
            if self.state is State.HOLDING:
                self._set_state(State.RUNNING)
            await self._ack(self._ack_of(d))
        elif d.kind is DirectiveKind.DRAIN:
            await self._cancel_rendezvous()
            await self._cancel_prepare()
            self._set_state(State.DRAINING)
            # The worker is holding after the checkpoint, so it has nothing left to lose: ack
            # first, the others' rendezvous need not wait for this process to exit.
            if self.workers.worker is not None:
                self.workers.expect_exit()
                self.workers.send(Exit())
            await self._ack(self._ack_of(d))
            await self.workers.stop()
            self._set_state(State.DONE)
            self.stop(0)
        elif d.kind is DirectiveKind.STOP:
            await self._cancel_rendezvous()
            await self._cancel_prepare()
            self.workers.kill()
            await self._ack(self._ack_of(d))
            self._set_state(State.DONE)
            self.stop(0)
        else:
            await self._ack(self._ack_of(d, ok=False, message=f"unknown kind {d.kind_name}"))

    def _fail_pending_if_no_worker(self) -> None:
        if not self.workers.current_alive():
            for did, d in list(self._pending_acks.items()):
                self._pending_acks.pop(did)
                self._spawn_task(self._ack(self._ack_of(d, False, "no running worker")), "nack")

    async def _cancel_prepare(self) -> None:
        task, self._prepare_task = self._prepare_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _prepare(self, d: Directive) -> None:
        """Overlap mode: the standby workers form the next generation's group now; acked
        once they have, nacked when they cannot (the coordinator falls back or aborts)."""
        rdv = d.rendezvous
        assert rdv is not None
        if self.state in LEAVING:
            await self._ack(self._ack_of(d, ok=False, message="this member is leaving"))
            return
        short = self._memory_shortfall()
        if short:
            logger.warning("member %s cannot prepare: %s", self.member_id, short)
            await self._ack(self._ack_of(d, ok=False, message=short))
            return
        ranks = [
            WorkerPlace(rdv.rank, rdv.world_size, i, self.devices.workers).rank
            for i in range(self.devices.workers)
        ]
        started = time.monotonic()
        try:
            group_init_s = await self.workers.prepare(
                rendezvous_envs(d, self.devices, 0.0), rdv.generation, self.s.start_timeout_s
            )
        except (TimeoutError, Unavailable) as exc:
            logger.warning(
                "member %s (job %s) could not prepare generation %d: %s",
                self.member_id,
                self.s.job_id,
                rdv.generation,
                exc or "timed out",
            )
            await self._ack(self._ack_of(d, ok=False, message=f"could not prepare: {exc}"))
            return
        logger.info(
            "member %s prepared generation %d ranks %d..%d of %d: group in %.3fs (%.3fs in all)",
            self.member_id,
            rdv.generation,
            ranks[0],
            ranks[-1],
            rdv.world_size * self.devices.workers,
            group_init_s,
            time.monotonic() - started,
        )
        if self.workers.worker is None:
            # A newcomer: its state comes from a peer, over the group, once the stayers join.
            self._start_prepared(rdv.generation, 0)
            if rdv.prepared:
                # The barrier commits: the stayers' prepared workers join that transfer only
                # once they switched at their hold, so once restored this one may train.
                self._go_prepared(rdv.generation)
        await self._ack(self._ack_of(d))

    def _start_prepared(self, generation: int, restore_step: int) -> None:
        envs = [{RESTORE_STEP_ENV: str(restore_step)}] * self.devices.workers
        self.workers.start_prepared(generation, envs)

    def _go_prepared(self, generation: int) -> bool:
        envs = [{RESTART_STARTED_AT_ENV: repr(time.time())}] * self.devices.workers
        return self.workers.go_prepared(generation, envs)

    def _memory_shortfall(self) -> str:
        """Why a prepared worker would not fit on this pod's GPUs now, or ""."""
        if self.devices.backend is not Backend.NCCL or not self.s.prepare_min_free_mib:
            return ""
        gpus = [g for i in range(self.devices.workers) if (g := self.devices.gpu_of(i))]
        free = gpu_free_mib(gpus)
        if free is None:
            return "NVML cannot tell the GPUs' free memory; prepare_min_free_mib needs it"
        return memory_shortfall(free, self.s.prepare_min_free_mib)

    async def _cancel_rendezvous(self) -> None:
        task, self._rendezvous_task = self._rendezvous_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Nobody waits for that start now: its worker's exit must not fail an unread future.
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()

    async def _rendezvous(self, d: Directive) -> None:
        rdv = d.rendezvous
        assert rdv is not None
        restart_started_at = time.time()
        if not rdv.prepared:
            # A fallback (or a plain resize): a prepare still under way is moot.
            await self._cancel_prepare()
        left = self.state
        ahead = 0 if rdv.prepared else self.workers.went_ahead_step()
        self._set_state(State.STARTING)
        if (
            self.workers.worker is not None
            and self.generation
            and left
            in (
                State.RUNNING,
                State.FAILED,
            )
        ):
            # Not held: a loss broke the old generation. Where its worker stopped may be a
            # step past what the coordinator heard, and it counts the lost steps from it.
            self.link.send_last_word(self._beat())
        elif ahead > self.progress.step:
            # This member switched at a committing barrier that then failed: the steps its
            # prepared worker trained in the generation that never opened are lost, and the
            # coordinator counts them from this last word.
            beat = self._beat()
            progress = dataclasses.replace(beat.progress, step=ahead)
            self.link.send_last_word(dataclasses.replace(beat, progress=progress))
        if rdv.start_delay_s > 0:
            # The coordinator's restart backoff (a re-form after a loss, in a row): a worker
            # that dies at every start must not make the job re-form once a second.
            logger.warning(
                "member %s (job %s): restart backoff, generation %d starts its workers in %.1fs",
                self.member_id,
                self.s.job_id,
                d.generation,
                rdv.start_delay_s,
            )
            await self.workers.stop()
            await asyncio.sleep(rdv.start_delay_s)
            self._set_state(State.STARTING)  # not FAILED by the old worker's crash as it stopped
        self.worker_exit = None
        self.generation = d.generation
        # At the restore step, not 0: the coordinator measures step rates from heartbeats,
        # and a 0 before the worker's Ready made the first second of a generation look
        # like restore_step steps.
        self.progress = WorkerProgress(step=rdv.restore_step)
        self._ready = asyncio.get_running_loop().create_future()
        self.workers.forget_queued()
        self._worker_done = False
        envs = rendezvous_envs(d, self.devices, restart_started_at)
        ranks = [
            WorkerPlace(rdv.rank, rdv.world_size, i, self.devices.workers).rank
            for i in range(self.devices.workers)
        ]
        worker, woke = await self.workers.start_generation(
            envs, d.generation, ranks, prepared=rdv.prepared
        )
        logger.info(
            "member %s %s worker pid %d: generation %d ranks %d..%d of %d restore %d",
            self.member_id,
            "woke prewarmed" if woke else "started",
            worker.pid,
            d.generation,
            ranks[0],
            ranks[-1],
            rdv.world_size * self.devices.workers,
            rdv.restore_step,
        )
        try:
            async with asyncio.timeout(self.s.start_timeout_s):
                ready = await asyncio.shield(self._ready)
        except (TimeoutError, RuntimeError) as exc:
            # Stopped before the nack: the coordinator re-forms the job without this
            # generation, and a late starter would train in it beside the next one. The
            # start is over: its exit must not be reported to a future nobody awaits.
            if self._ready is not None and not self._ready.done():
                self._ready.cancel()
            await self.workers.stop()
            await self._ack(self._ack_of(d, ok=False, message=f"worker did not start: {exc}"))
            return
        logger.info(
            "member %s worker ready in generation %d at step %d",
            self.member_id,
            d.generation,
            ready.restored_step,
        )
        # What it restored, which may be newer than the step named: the coordinator counts
        # the steps this generation redoes from it.
        await self._ack(dataclasses.replace(self._ack_of(d), restored_step=ready.restored_step))

    # -- the worker -------------------------------------------------------------------------

    async def _on_worker_exit(self, worker: WorkerHandle, code: int, expected: bool) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(RuntimeError(f"worker exited with {code}"))
        if expected:
            return
        if self.workers.adopted_ended(worker) and self._rendezvous_task is not None:
            # It ended before the RENDEZVOUS that made it current: that ack goes first.
            await asyncio.wait([self._rendezvous_task])
        if self._worker_done and code == 0:
            if not await self.workers.followers_finished():
                return
            logger.info(
                "member %s (job %s): training finished at step %d; launcher exits",
                self.member_id,
                self.s.job_id,
                self.progress.step,
            )
            self._set_state(State.DONE)
            # Phase IDLE in the current generation with the final step: the coordinator
            # marks the member finished instead of waiting for its silence to look like a loss.
            await self.link.final_heartbeat()
            self.stop(0)
            return
        if self.state is State.FAILED:
            # Another of the pod's workers died first (or with it): the pod has failed once.
            logger.warning(
                "member %s: worker pid %d also exited with %d", self.member_id, worker.pid, code
            )
            return
        self.worker_exit = worker_exit(code, self.workers.log_path(worker.pid))
        logger.error(
            "member %s (job %s): worker pid %d %s in generation %d",
            self.member_id,
            self.s.job_id,
            worker.pid,
            self.worker_exit.cause,
            self.generation,
        )
        self._set_state(State.FAILED)
        self._fail_pending_if_no_worker()
        await self.link.heartbeat_quietly()

    async def _on_worker_message(self, msg: ToLauncher) -> None:
        p = self.progress
        if isinstance(msg, Ready):
            p.worker_restart_s = msg.worker_restart_s
            p.group_init_s = msg.group_init_s
            p.restore_s = msg.restore_s
            p.step = msg.restored_step
            if self._ready is not None and not self._ready.done():
                self._ready.set_result(msg)
            self.link.wake_heartbeat()
        elif isinstance(msg, Progress):
            first = p.first_step_at
            p.step, p.epoch, p.cursor = msg.step, msg.epoch, msg.cursor
            p.samples_per_s = msg.samples_per_s
            p.first_step_at = msg.first_step_at
            if p.first_step_at and not first:
                if self.state is State.STARTING:
                    self._set_state(State.RUNNING)
                self.link.wake_heartbeat()
                # The next generation's worker warms up while this one trains.
                self.workers.ensure_standby_soon()
        elif isinstance(msg, Held):
            await self._on_held(msg)
        elif isinstance(msg, Resumed):
            if self.state is State.HOLDING:
                self._set_state(State.RUNNING)
        elif isinstance(msg, CheckpointWritten):
            if msg.step > self.checkpoint.step and msg.digest:
                self.checkpoint = DurableCheckpoint(msg.step, msg.digest, msg.lag_s, time.time())
                # At once, not at the next beat: a loss right after this write must restore it.
                self.link.wake_heartbeat()
            logger.info(
                "member %s: checkpoint of step %d written (%s)",
                self.member_id,
                msg.step,
                "periodic" if msg.periodic else "coordinated",
            )
        elif isinstance(msg, Done):
            self._worker_done = True
        else:
            logger.warning("member %s: unexpected worker message %s", self.member_id, msg.TYPE)

    async def _on_held(self, msg: Held) -> None:
        if self.state in (State.RUNNING, State.STARTING):
            self._set_state(State.HOLDING)
        ckpt = msg.checkpoint
        for did in msg.directive_ids:
            d = self._pending_acks.get(did)
            if d is None or d.kind is not DirectiveKind.CHECKPOINT:
                continue
            # Overlap mode: the state of the barrier's step is in this pod's memory now, so a
            # prepared next worker restores it while the acks travel.
            rdv = d.rendezvous
            self._start_prepared(rdv.generation if rdv else self.generation + 1, msg.step)
            if rdv is not None and msg.step >= d.checkpoint_step:
                # The CHECKPOINT carried g+1's RENDEZVOUS: the barrier commits here and the
                # prepared worker trains on without the coordinator's round trip. Past S too
                # (it came after g passed S): every rank held at this one step, where the
                # coordinator moves the barrier. A hold before S (asked for another reason)
                # stays in g, which the coordinator then resumes.
                went = self._go_prepared(rdv.generation)
                if went:
                    self.workers.retire_current()
                logger.info(
                    "member %s committed to generation %d at step %d%s",
                    self.member_id,
                    rdv.generation,
                    msg.step,
                    "" if went else " (no prepared worker: it starts with the RENDEZVOUS)",
                )
        for did in msg.directive_ids:
            d = self._pending_acks.pop(did, None)
            if d is None:
                continue
            await self._ack(
                Ack(
                    directive_id=d.directive_id,
                    generation=d.generation,
                    held_at=msg.held_at,
                    checkpoint_step=msg.step,
                    checkpoint_digest=ckpt.digest if ckpt else "",
                    checkpoint_write_s=ckpt.write_s if ckpt else 0.0,
                )
            )
