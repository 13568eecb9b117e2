"""Worker supervision: the zygote, the prewarmed worker, starting, stopping and watching.

The launcher core decides when a generation starts and what an exit means; this module
does the process work:

- **Spawning** through a :class:`~tide.trainer.spawner.Spawner` (the warm zygote, or fresh
  processes).
- **The prewarmed worker** (the *standby*): one worker forked ahead of time that imports,
  builds its model and waits for a :class:`~tide.trainer.messages.Rendezvous`. One that dies
  before its rendezvous (its zygote was killed, the script failed while building) is
  replaced after a :class:`tide.base.retry.Backoff` delay, and the spawn restarts a dead
  zygote, so the next RENDEZVOUS finds one ready.
- **Stopping**: ask the worker to :class:`~tide.trainer.messages.Exit`, SIGKILL after the grace
  (it may be blocked in a collective with a dead peer).
- **Watching**: when the current worker exits, the core hears it only after the worker's
  connection has been read to its end (its last step, its last checkpoint, "done").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from pathlib import Path
from typing import Any

from tide.base.cpuwait import process_thread_waits_s, waited_since
from tide.base.errors import Unavailable
from tide.base.retry import Backoff
from tide.trainer.channel import CONTROL_SOCKET_ENV
from tide.trainer.distenv import PREWARM_ENV
from tide.trainer.launcher.control import ControlServer
from tide.trainer.launcher.logs import rotate
from tide.trainer.launcher.settings import LauncherSettings
from tide.trainer.messages import (
    Exit,
    Go,
    Prepared,
    Progress,
    Rendezvous,
    Start,
    ToLauncher,
    ToWorker,
)
from tide.trainer.spawner import Spawner, WorkerHandle

logger = logging.getLogger(__name__)

#: The niceness of a worker that will not train again (it exits, or its successor took over):
#: its teardown and its last background write yield the pod's CPUs to the worker that trains.
RETIRED_NICE = 19


def lower_priority(pid: int) -> None:
    """Every thread of ``pid`` to :data:`RETIRED_NICE` (on Linux a priority is per thread; the
    worker's background checkpoint writer is one). Best effort: raising one's own processes'
    niceness needs no privilege, and a process that is gone has nothing to yield."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, tid, RETIRED_NICE)


def _running(pid: int) -> bool:
    """False once ``pid`` has ended: gone, or a zombie its parent has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _retire(pid: int) -> dict[int, float]:
    """``pid`` lowered to :data:`RETIRED_NICE`, and its threads' CPU waits from then."""
    lower_priority(pid)
    return process_thread_waits_s(pid)


#: What the PaddleJob operators set that would contradict a generation's world.
OPERATOR_PADDLE_ENV = frozenset(
    {
        "PADDLE_TRAINER_ID",
        "PADDLE_TRAINERS_NUM",
        "PADDLE_TRAINER_ENDPOINTS",
        "PADDLE_CURRENT_ENDPOINT",
        "PADDLE_MASTER",
        "PADDLE_RANK_IN_NODE",
        "PADDLE_NNODES",
        "PADDLE_TRAINERS",
        "PADDLE_ELASTIC_NP",
        "PADDLE_ELASTIC_JOB_ID",
        "PADDLE_ELASTIC_TIMEOUT",
    }
)

# How long a dead worker's connection may stay silent, nothing read and nothing being
# handled, before its end is judged on what was read, seconds; and the longest its lines are
# waited for while they keep coming or being handled.
CHANNEL_DRAIN_S = 0.5
CHANNEL_DRAIN_MOST_S = 10.0


class WorkerSupervisor:
    def __init__(
        self,
        settings: LauncherSettings,
        spawner: Spawner,
        state_dir: Path,
        may_prewarm: Callable[[], bool],
        on_exit: Callable[[WorkerHandle, int, bool], Awaitable[None]],
        on_message: Callable[[ToLauncher], Awaitable[None]],
        member_id: Callable[[], str] = lambda: "",
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        # on_exit(worker, code, expected) runs when the current worker has exited and its
        # connection is drained; on_message(msg) for each message of the current worker.
        self.s = settings
        self.spawner = spawner
        self._state_dir = state_dir
        self._may_prewarm = may_prewarm
        self._on_exit = on_exit
        self._on_current_message = on_message
        self.control = ControlServer(self._accept, self._on_message, self._on_hello)
        self.worker: WorkerHandle | None = None
        self.standby: WorkerHandle | None = None
        self._standby_seq = 0
        self._standby_backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s)
        # The current worker's exit was asked for (stop, drain): not a failure.
        self._expected_exit = False
        # The current worker when a new generation's start was asked for: its exit from then
        # on is no one's news (see _watch).
        self._replaced: WorkerHandle | None = None
        # For the current worker until it has connected.
        self._queued: list[ToWorker] = []
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._member_id = member_id
        # What this worker always has (its device pinning, its local rank): tide/trainer/devices.py.
        self._extra_env = dict(extra_env or {})
        # Overlap mode: the standby holds the group of this generation (generation, pid); and
        # the Prepared a standby is being waited for (pid, future).
        self._prepared: tuple[int, int] | None = None
        self._preparing: tuple[int, asyncio.Future[Prepared]] | None = None
        # The prepared standby was told to restore (Start) and to train (Go: overlap mode's
        # commit at the barrier), and what it said before it became the current worker.
        self._prepared_started = False
        self._prepared_went = False
        self._prepared_said: list[ToLauncher] = []
        # The current worker, when the RENDEZVOUS made it current after it had ended: it
        # went at the barrier and the coordinator was away (its exit waits for that ack).
        self.adopted_ended: WorkerHandle | None = None
        # Each worker's log file, by pid (the live ones' and the last few dead ones').
        self._logs: dict[int, str] = {}

    @property
    def member_id(self) -> str:
        """For logs: the member this launcher is (empty until it has registered)."""
        return self._member_id()

    def _spawn_task(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def start(self) -> float:
        """Open the control socket and wait for the spawner; returns its warm-up, seconds."""
        await self.control.start()
        return await self.spawner.wait_ready()

    async def close(self) -> None:
        self._closing = True
        for t in list(self._tasks):
            t.cancel()
        if self.worker is not None and self.worker.returncode is None:
            await self.stop(self.worker)
        if self.standby is not None:
            self.standby.kill()
        await self.spawner.close()
        self.control.close()

    def base_env(self) -> dict[str, str]:
        # A PaddleJob operator gives the pod its own PADDLE_* world (paddle-operator's
        # PADDLE_TRAINER_ID is the pod index, Kubeflow's PADDLE_NNODES the replicas);
        # under Tide each generation's world comes from the coordinator instead.
        env = {k: v for k, v in os.environ.items() if k not in OPERATOR_PADDLE_ENV}
        env.update(self._extra_env)
        env[CONTROL_SOCKET_ENV] = self.control.path
        return env

    # -- the control socket, seen from the current worker ---------------------------------

    def _accept(self, pid: int) -> bool:
        return pid in [w.pid for w in (self.worker, self.standby) if w is not None]

    def _on_hello(self, pid: int) -> None:
        if self.worker is not None and pid == self.worker.pid:
            pending, self._queued = self._queued, []
            for m in pending:
                self.send(m)

    async def _on_message(self, pid: int, msg: ToLauncher) -> None:
        # Only the current worker speaks for this member; a standby only waits, or reports
        # that it prepared a generation.
        if self.worker is not None and pid == self.worker.pid:
            await self._on_current_message(msg)
        elif isinstance(msg, Prepared) and self._preparing is not None:
            want, fut = self._preparing
            if pid == want and not fut.done():
                fut.set_result(msg)
        elif self._prepared is not None and self._prepared[1] == pid:
            # Restored ahead (and, once it went, training): it becomes this member's word
            # once the RENDEZVOUS makes the standby the current worker.
            self._prepared_said.append(msg)

    def send(self, msg: ToWorker) -> None:
        """To the current worker; queued until it has connected."""
        if self.worker is None or not self.control.send(self.worker.pid, msg):
            self._queued.append(msg)

    def forget_queued(self) -> None:
        """Nothing queued for the old worker may reach the new one."""
        self._queued = []

    # -- the prewarmed worker -------------------------------------------------------------

    def standby_ready(self) -> bool:
        s = self.standby
        return s is not None and s.returncode is None and self.control.connected(s.pid)

    async def ensure_standby(self) -> None:
        """Fork the next generation's worker ahead of time: it imports, builds its model and
        waits in init_process_group for a RENDEZVOUS, so a restart costs no start-up."""
        if not self.s.prewarm or self._closing or not self._may_prewarm():
            return
        if self.standby is not None and (self.standby.returncode is None or self._ended_ahead()):
            return
        self._standby_seq += 1
        env = self.base_env()
        env[PREWARM_ENV] = "1"
        log_path = str(self._state_dir / f"worker-standby-{self._standby_seq}.log")
        standby = await self.spawner.spawn(self.s.command, env, os.getcwd(), log_path)
        self._spawned(standby, log_path)
        self.standby = standby
        self._spawn_task(self._watch_standby(standby), "watch-standby")
        logger.info("member %s prewarmed worker pid %d", self.member_id, standby.pid)

    def ensure_standby_soon(self) -> None:
        self._spawn_task(self.ensure_standby(), "prewarm")

    async def _watch_standby(self, standby: WorkerHandle) -> None:
        code = await standby.wait()
        if self._preparing is not None and self._preparing[0] == standby.pid:
            fut = self._preparing[1]
            if not fut.done():
                fut.set_exception(Unavailable(f"the standby worker exited with {code}"))
        if self.standby is not standby or self._closing:
            return
        if self._ended_ahead():
            # It went at the barrier's commit and trained g+1 on until it ended (the budget
            # done, or a failure) before the RENDEZVOUS came: the coordinator was away. Still
            # this member's worker of that generation, with its words: the RENDEZVOUS makes
            # it the current worker and its end is reported then. A fresh worker in its place
            # would join a group whose other ranks are gone.
            logger.warning(
                "member %s (job %s): prepared worker pid %d of generation %d exited with %d"
                " before its RENDEZVOUS; kept as this member's worker of it",
                self.member_id,
                self.s.job_id,
                standby.pid,
                self._prepared[0] if self._prepared else 0,
                code,
            )
            return
        self.standby = None
        self._forget_prepared()
        delay = self._standby_backoff.next_delay_s()
        logger.warning(
            "member %s (job %s): prewarmed worker pid %d exited with %d; another in %.2fs",
            self.member_id,
            self.s.job_id,
            standby.pid,
            code,
            delay,
        )
        await asyncio.sleep(delay)
        try:
            await self.ensure_standby()
        except Exception:
            # The next RENDEZVOUS spawns a worker itself; a standby is only a head start.
            logger.exception("member %s: could not fork a prewarmed worker", self.member_id)

    # -- overlap mode: a generation prepared ahead --------------------------------------

    def prepared_for(self, generation: int) -> bool:
        """The standby holds the group of ``generation`` and is alive, or it went at the
        barrier's commit and has ended since (:meth:`_ended_ahead`)."""
        s = self.standby
        if s is None or self._prepared != (generation, s.pid):
            return False
        if s.returncode is not None:
            return self._ended_ahead()
        return self.control.connected(s.pid)

    def _ended_ahead(self) -> bool:
        """The prepared standby went (trained g+1 before its RENDEZVOUS) and has exited."""
        s = self.standby
        return (
            s is not None
            and s.returncode is not None
            and self._prepared_went
            and self._prepared is not None
            and self._prepared[1] == s.pid
        )

    def discard_prepared(self) -> None:
        """A standby that joined some generation's group cannot join another: it goes (a
        fresh standby is forked when next wanted)."""
        if self._prepared is None:
            return
        standby, self.standby = self.standby, None
        self._forget_prepared()
        if standby is not None and standby.returncode is None:
            logger.info("member %s: prepared worker pid %d discarded", self.member_id, standby.pid)
            standby.kill()

    async def prepare(self, env: Mapping[str, str], generation: int, timeout_s: float) -> Prepared:
        """The standby joins ``generation``'s group now, while the current worker trains;
        returns once it has (Unavailable or TimeoutError when it cannot)."""
        if not self.s.prewarm:
            raise Unavailable("overlap mode needs a prewarmed standby worker (prewarm is off)")
        self.discard_prepared()
        async with asyncio.timeout(timeout_s):
            await self.ensure_standby()
            standby = self.standby
            if standby is None:
                raise Unavailable("no standby worker could be forked")
            while not self.control.connected(standby.pid):
                if standby.returncode is not None:
                    raise Unavailable(f"the standby worker exited with {standby.returncode}")
                # Until the standby has imported, built its model and connected.
                await asyncio.sleep(0.02)
            fut: asyncio.Future[Prepared] = asyncio.get_running_loop().create_future()
            self._preparing = (standby.pid, fut)
            try:
                self.control.send(standby.pid, Rendezvous(env=dict(env)))
                prepared = await fut
            finally:
                self._preparing = None
        self._forget_prepared()
        self._prepared = (generation, standby.pid)
        return prepared

    def start_prepared(self, generation: int, env: Mapping[str, str]) -> None:
        """The standby prepared for ``generation`` restores now (``env``: the restore step)
        and then waits for its go; at most once."""
        s = self.standby
        if s is None or self._prepared_started or not self.prepared_for(generation):
            return
        self._prepared_started = True
        self.control.send(s.pid, Start(env=dict(env)))

    def go_prepared(self, generation: int, env: Mapping[str, str]) -> bool:
        """The standby prepared (and started) for ``generation`` trains as soon as it has
        restored, before the RENDEZVOUS makes it the current worker: overlap mode's commit at
        the barrier. At most once; False when there is no such standby."""
        s = self.standby
        if s is None or not self._prepared_started or not self.prepared_for(generation):
            return False
        if not self._prepared_went:
            self._prepared_went = True
            self.control.send(s.pid, Go(env=dict(env)))
        return True

    def retire_current(self) -> None:
        """The current worker will not train again (overlap mode's commit at the barrier):
        what it still does (its durable write, its exit) yields to its successor."""
        if self.worker is not None and self.worker.returncode is None:
            lower_priority(self.worker.pid)

    def went_ahead_step(self) -> int:
        """The step a prepared standby that went has reported (0: none went, or no step):
        steps a generation that never opened trained, for the lost-step count."""
        steps = [m.step for m in self._prepared_said if isinstance(m, Progress)]
        return max(steps, default=0) if self._prepared_went else 0

    def _forget_prepared(self) -> None:
        self._prepared = None
        self._prepared_started, self._prepared_went = False, False
        self._prepared_said = []

    # -- a generation's worker ------------------------------------------------------------

    @property
    def replacing(self) -> bool:
        """The current worker is the one a new generation's start replaces (its messages
        until the switch are the old generation's)."""
        return self.worker is not None and self.worker is self._replaced

    def start_generation(
        self, env: Mapping[str, str], generation: int, rank: int, prepared: bool = False
    ) -> Coroutine[Any, Any, tuple[WorkerHandle, bool]]:
        """The worker of a new generation, and whether it is the woken standby. The old
        worker is asked to exit: alongside when the standby takes over (they share
        nothing), before the spawn otherwise. ``prepared``: the standby formed this
        generation's group ahead and only needs its Start.

        The old worker is replaced at the call, not when the returned coroutine first runs:
        the pod's workers start in tasks (WorkerGroup), a loop turn after the launcher core
        began waiting for the new generation's Ready, and an exit of the old worker handled
        in that turn (one that crashed as the RENDEZVOUS came) failed the new start."""
        self._replaced = self.worker
        return self._start_generation(env, generation, rank, prepared)

    async def _start_generation(
        self, env: Mapping[str, str], generation: int, rank: int, prepared: bool
    ) -> tuple[WorkerHandle, bool]:
        old = self.worker
        self.adopted_ended = None
        if prepared and self.prepared_for(generation):
            self.start_prepared(generation, env)
            standby = self.standby
            assert standby is not None
            if standby.returncode is not None:
                self.adopted_ended = standby
            said, went = self._prepared_said, self._prepared_went
            self.standby = None
            self._forget_prepared()
            self._standby_backoff.reset()
            self.worker = standby
            self._expected_exit = False
            if old is not None:
                self._spawn_task(self.stop(old), "stop-old-worker")
            if not went:
                self.send(Go(env=dict(env)))
            worker = self.worker
            for msg in said:
                await self._on_current_message(msg)
            # Watched only once what it said is told: one that ended before this RENDEZVOUS
            # (it went at the barrier, the coordinator was away) is judged by all of it (its
            # restore, its steps, "done"), like any worker's exit.
            self._spawn_task(self._watch(worker), "watch-worker")
            return worker, True
        self.discard_prepared()
        if self.standby_ready():
            standby = self.standby
            assert standby is not None
            self.standby = None
            self._standby_backoff.reset()
            self.worker = standby
            self._expected_exit = False
            if old is not None:
                self._spawn_task(self.stop(old), "stop-old-worker")
            self.send(Rendezvous(env=dict(env)))
            woke = True
        else:
            if old is not None:
                await self.stop(old)
            self._expected_exit = False
            log_path = str(self._state_dir / f"worker-g{generation}-r{rank}.log")
            self.worker = await self.spawner.spawn(
                self.s.command, {**self.base_env(), **env}, os.getcwd(), log_path
            )
            self._spawned(self.worker, log_path)
            woke = False
        worker = self.worker
        self._spawn_task(self._watch(worker), "watch-worker")
        return worker, woke

    def _spawned(self, worker: WorkerHandle, log_path: str) -> None:
        """Remember ``worker``'s log and rotate the folder's: the live workers' logs stay."""
        live = {w.pid for w in (self.worker, self.standby, worker) if w is not None}
        self._logs = {pid: p for pid, p in self._logs.items() if pid in live}
        self._logs[worker.pid] = log_path
        rotate(self._state_dir, self.s.worker_logs_kept, set(self._logs.values()))

    def log_path(self, pid: int) -> str | None:
        """The log file of the worker ``pid`` (current, standby, or the last to die)."""
        return self._logs.get(pid)

    def expect_exit(self) -> None:
        """The current worker's next exit is asked for (a drain or stop)."""
        self._expected_exit = True

    def current_alive(self) -> bool:
        return self.worker is not None and self.worker.returncode is None

    async def stop(self, worker: WorkerHandle | None = None) -> None:
        """Ask ``worker`` (default: the current one) to exit; SIGKILL it after the grace."""
        worker = worker or self.worker
        if worker is None or worker.returncode is not None:
            return
        if worker is self.worker:
            self._expected_exit = True
        # /proc reads, one per thread of the worker: off the event loop.
        waits_before = await asyncio.to_thread(_retire, worker.pid)
        self.control.send(worker.pid, Exit())
        try:
            async with asyncio.timeout(self.s.exit_grace_s):
                await worker.wait()
        except TimeoutError:
            if not await asyncio.to_thread(_running, worker.pid):
                # It ended, and its end was read late: this launcher's loop or its zygote
                # (which reports a forked worker's end) waited for a CPU. Two CI runs logged
                # "0.00s of it waiting" for a worker that had logged its exit at once.
                logger.info(
                    "member %s: worker pid %d ended as its %.1fs exit grace ran out (its end"
                    " read late)",
                    self.member_id,
                    worker.pid,
                    self.s.exit_grace_s,
                )
                await worker.wait()
                return
            # A worker lowered to nice 19 on a machine with more runnable work than cores
            # may get no CPU to exit within the grace: the machine's state, not a worker
            # that ignored its exit (on 2 shared cores at load 15-25, a WARNING in about
            # one healthy run in three; issue 32). Every thread's wait counts, summed: the exit
            # needs the channel's reader, then the main thread, which sleeps meanwhile. (A
            # hung worker whose threads spin at nice 19 on a loaded machine sums high too,
            # and reads as starved: at INFO, still SIGKILLed.)
            waits = await asyncio.to_thread(process_thread_waits_s, worker.pid)
            starved_s = waited_since(waits_before, waits)
            logger.log(
                logging.INFO if starved_s >= self.s.exit_grace_s / 2 else logging.WARNING,
                "member %s: worker pid %d did not exit within %.1fs (%.2fs of it waiting for"
                " a CPU); SIGKILL",
                self.member_id,
                worker.pid,
                self.s.exit_grace_s,
                starved_s,
            )
            worker.kill(signal.SIGKILL)
            await worker.wait()

    def kill(self) -> None:
        """SIGKILL the current worker (a STOP directive); its exit is expected."""
        self._expected_exit = True
        if self.worker is not None:
            self.worker.kill()

    async def _watch(self, worker: WorkerHandle) -> None:
        code = await worker.wait()
        # What the worker said last may still be unread; judge only after it was handled.
        await self.control.drained(worker.pid, CHANNEL_DRAIN_S, CHANNEL_DRAIN_MOST_S)
        # A replaced worker's exit was asked for by the start of the next generation, which
        # already waits on its successor: reported, it would fail that start (the member
        # nacks its RENDEZVOUS and is lost) or, once the flag is reset, look like a crash.
        if worker is not self.worker or worker is self._replaced:
            return
        await self._on_exit(worker, code, self._expected_exit)
