"""Run an elastic job on this machine: a coordinator process and launcher processes.

A test double (it plays the scaler and the actuator), used by the end-to-end tests and
bench/rescale.py. It plays the scaler's part (``Resize``) and
the actuator's (starting and killing launchers as "pods"), and reads the logs that
tide/trainer/examples/train_mlp.py writes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tide.base.listening import parse_listening
from tide.services.testing.ports import free_port
from tide.trainer import template
from tide.v1 import coordinator_pb2 as pb
from tide.v1 import coordinator_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent.parent.parent
EXAMPLE = str(ROOT / "tide" / "trainer" / "examples" / "train_mlp.py")
RPC_TIMEOUT_S = 5.0
FINAL_PHASES = (
    pb.RESIZE_PHASE_COMPLETED,
    pb.RESIZE_PHASE_ABORTED,
    pb.RESIZE_PHASE_FAILED,
)


@dataclass
class Pod:
    name: str
    index: int
    proc: subprocess.Popen[bytes]
    state_dir: Path

    def kill_launcher(self) -> None:
        """SIGKILL the launcher: its zygote sees stdin close and its worker gets PDEATHSIG."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def worker_pids(self) -> list[int]:
        """Pids of this pod's worker processes (grandchildren through the zygote): the one
        that trains, and also the prewarmed standby and a replaced worker still exiting, in
        the order they were forked, which says nothing about which one trains (see
        :meth:`training_worker`)."""
        out: list[int] = []
        for child in _children(self.proc.pid):
            if b"tide.trainer.zygote" in _cmdline(child):
                out.extend(_children(template.zygote_of(child)))
            else:
                out.append(child)
        return out

    def training_worker(self, generation: int) -> int:
        """The pid of the worker that trains in ``generation`` for this pod, as its launcher
        logged it at the rendezvous, checked to be alive and still this pod's worker.
        Raises when there is none: a test that means to kill a training worker must not
        kill a standby, whose loss re-forms nothing. One worker a pod (the log line names
        the first of several)."""
        log = (self.state_dir / "launcher.log").read_text(errors="replace")
        started = [int(m.group(1)) for m in _STARTED.finditer(log) if int(m.group(2)) == generation]
        if not started:
            raise AssertionError(f"{self.name}: no worker started in generation {generation}")
        pid = started[-1]
        if pid not in self.worker_pids() or _state(pid) in ("Z", "X", ""):
            raise AssertionError(
                f"{self.name}: the worker pid {pid} of generation {generation} is not running"
            )
        return pid


# tide/trainer/launcher/core.py's line when a generation's worker starts (a prewarmed standby
# woken, or a fresh one forked).
_STARTED = re.compile(r"(?:woke prewarmed|started) worker pid (\d+): generation (\d+) ")


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (Z: a zombie), "" when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[0]


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@dataclass
class LocalJob:
    """One job: ``job_id`` on a coordinator started here, with launchers as pods."""

    workdir: Path
    train_args: Sequence[str]
    job_id: str = "ns/e2e"
    heartbeat_timeout_s: float = 4.0
    heartbeat_interval_s: float = 0.5
    checkpoint_lead_s: float = 1.0
    # The coordinator's resize_mode: "plain", or "overlap" (g+1's group forms before the
    # barrier, docs/resize-protocol.md).
    resize_mode: str = "plain"
    use_zygote: bool = True
    # The training script each pod's launcher runs, and the launcher's own extra flags
    # (``--workers-per-pod 2``).
    example: str = EXAMPLE
    launcher_args: Sequence[str] = ()
    # False: no volume shared by the pods; each pod's checkpoints go to its own directory.
    shared_checkpoints: bool = True
    # True: the workers train only the steps the test grants (``--test-step-gate``,
    # tide/trainer/examples/step_gate.py), so an event the test issues lands mid-run however
    # fast or loaded the machine; ``resize`` grants the steps up to its barrier itself.
    step_gate: bool = False
    granted: int = 0
    pods: list[Pod] = field(default_factory=list)
    coordinator: subprocess.Popen[str] | None = None
    port: int = 0
    _channel: grpc.aio.Channel | None = None
    _decision: int = 0

    @property
    def stub(self) -> pb_grpc.CoordinatorAsyncStub:
        assert self._channel is not None
        return pb_grpc.CoordinatorStub(self._channel)

    @property
    def log_dir(self) -> Path:
        return self.workdir / "logs"

    @property
    def ckpt_dir(self) -> Path:
        return self.workdir / "ckpt"

    @property
    def gate_file(self) -> Path:
        return self.workdir / "step-gate"

    def grant(self, step: int) -> None:
        """A gated job may train through ``step`` (never fewer steps than granted before)."""
        if not self.step_gate or step <= self.granted:
            return
        self.granted = step
        self.workdir.mkdir(parents=True, exist_ok=True)
        tmp = self.gate_file.with_suffix(".tmp")
        tmp.write_text(str(step))
        os.replace(tmp, self.gate_file)

    def release(self) -> None:
        """A gated job trains on to its end."""
        self.grant(sys.maxsize)

    def steps_budget(self) -> int:
        """The run's ``--steps`` (0: not given)."""
        args = list(self.train_args)
        return int(args[args.index("--steps") + 1]) if "--steps" in args else 0

    async def train_to(self, step: int, timeout_s: float, what: str) -> pb.JobStatus:
        """Grant a gated job the steps through ``step`` and wait until it has trained them.
        A gated job then waits at ``step`` (one past it, at a generation's first step) for
        the test's next event; one found further on means the gate failed, and the event
        would not land where the test says."""
        budget = self.steps_budget()
        if self.step_gate and budget and step >= budget:
            raise AssertionError(f"step {step} is past the run's {budget}: no event after it")
        self.grant(step)
        st = await self.wait_status(_past(step), timeout_s, what)
        if self.step_gate and st.step > self.granted + 1:
            raise AssertionError(f"the gate granted step {self.granted}, the job is at {st.step}")
        return st

    def start_coordinator(self, port: int = 0, timeout_s: float = 30.0) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [
            sys.executable,
            "-m",
            "tide.services.coordinator",
            "--listen",
            f"127.0.0.1:{port}",
            "--db",
            f"sqlite:///{self.workdir / 'coordinator.db'}",
            "--heartbeat-timeout-s",
            str(self.heartbeat_timeout_s),
            "--heartbeat-interval-s",
            str(self.heartbeat_interval_s),
            "--checkpoint-lead-s",
            str(self.checkpoint_lead_s),
            "--tick-interval-s",
            "0.1",
            "--resize-mode",
            self.resize_mode,
            # Loopback only, its callers this process's own launchers: no TLS files to
            # serve with, as in a test; a bench run outside pytest needs it said.
            "--insecure",
            "--log-level",
            "INFO",
        ]
        log = open(self.workdir / "coordinator.log", "a")  # noqa: SIM115
        proc = subprocess.Popen(
            args,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        log.close()
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            listening = parse_listening(line)
            if listening is not None:
                self.port = listening.grpc_port
                self.coordinator = proc
                # Keep draining stdout so the coordinator never blocks on a full pipe.
                asyncio.get_running_loop().run_in_executor(None, _drain, proc.stdout)
                if self._channel is None:
                    self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
                return
        proc.kill()
        raise RuntimeError(f"coordinator did not start; see {self.workdir / 'coordinator.log'}")

    def kill_coordinator(self) -> None:
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.send_signal(signal.SIGKILL)
            self.coordinator.wait(timeout=10)

    def add_pod(self, index: int, extra_train_args: Sequence[str] = ()) -> Pod:
        name = f"trainer-{index}"
        state_dir = self.workdir / name
        state_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "tide.trainer.launch",
            "--coordinator",
            f"127.0.0.1:{self.port}",
            "--job",
            self.job_id,
            "--pod",
            name,
            "--pod-index",
            str(index),
            "--state-dir",
            str(state_dir),
            "--exit-grace-s",
            "0.5",
            *([] if self.use_zygote else ["--no-zygote"]),
            *self.launcher_args,
            "--",
            sys.executable,
            self.example,
            "--ckpt-dir",
            str(self.ckpt_dir if self.shared_checkpoints else state_dir / "ckpt"),
            "--log-dir",
            str(self.log_dir),
            *self.train_args,
            *extra_train_args,
            *(["--test-step-gate", str(self.gate_file)] if self.step_gate else []),
        ]
        out = open(state_dir / "launcher.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=out, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        out.close()
        pod = Pod(name, index, proc, state_dir)
        self.pods.append(pod)
        return pod

    async def status(self) -> pb.JobStatus | None:
        try:
            st: pb.JobStatus = await self.stub.GetJobStatus(
                pb.GetJobStatusRequest(job_id=self.job_id), timeout=RPC_TIMEOUT_S
            )
            return st
        except grpc.aio.AioRpcError:
            return None

    async def wait_status(
        self, pred: Callable[[pb.JobStatus], bool], timeout_s: float, what: str
    ) -> pb.JobStatus:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            last = await self.status()
            if last is not None and pred(last):
                return last
            await asyncio.sleep(0.05)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last}")

    async def wait_standby(self, n: int, timeout_s: float = 120.0) -> pb.JobStatus:
        # 120 s: at the start of a `make test` session the four xdist workers each start 3-4
        # pods at once (a Paddle import each) on 2 shared cores; 60 s ran out at load 25.
        return await self.wait_status(
            lambda s: sum(m.state == pb.MEMBER_STATE_STANDBY for m in s.members) >= n,
            timeout_s,
            f"{n} standby members",
        )

    async def resize(
        self,
        target: int,
        deadline_s: float = 60.0,
        on_progress: Callable[[pb.ResizeProgress], None] | None = None,
        timeout_s: float = 120.0,
        decision_id: int = 0,
    ) -> list[pb.ResizeProgress]:
        """Scaler's part: Resize and follow its progress to a final phase. A known
        ``decision_id`` re-attaches to that resize (after a coordinator restart)."""
        if not decision_id:
            self._decision += 1
            decision_id = self._decision
        req = pb.ResizeRequest(
            decision_id=decision_id,
            job_id=self.job_id,
            target_world_size=target,
            deadline_s=deadline_s,
        )
        updates: list[pb.ResizeProgress] = []
        async for p in self.stub.Resize(req, timeout=timeout_s):
            updates.append(p)
            # The members train to the barrier's step and hold there (the session's own
            # hold): the steps up to it are the resize's, not the test's to withhold.
            self.grant(p.checkpoint_step)
            if on_progress is not None:
                on_progress(p)
            if p.phase in FINAL_PHASES:
                break
        return updates

    async def wait_pods_exit(self, timeout_s: float) -> list[int | None]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(p.proc.poll() is not None for p in self.pods):
                break
            await asyncio.sleep(0.1)
        return [p.proc.poll() for p in self.pods]

    async def close(self) -> None:
        for pod in self.pods:
            if pod.proc.poll() is None:
                pod.proc.terminate()
        for pod in self.pods:
            try:
                pod.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pod.proc.kill()
                pod.proc.wait(timeout=10)
        if self.coordinator is not None and self.coordinator.poll() is None:
            self.coordinator.terminate()
            try:
                self.coordinator.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.coordinator.kill()
                self.coordinator.wait(timeout=10)
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _drain(stream: Any) -> None:
    for _ in stream:
        pass


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except ValueError:
                # A worker SIGKILLed mid-line leaves a torn last line.
                continue
    return out


def loss_records(log_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(log_dir / "loss.jsonl")


def sample_records(log_dir: Path) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(log_dir.glob("samples-rank*-g*.jsonl")):
        out.extend(read_jsonl(path))
    return out


def reference_run(
    workdir: Path,
    train_args: Sequence[str],
    world_size: int = 2,
    timeout_s: float = 120.0,
    example: str = EXAMPLE,
) -> Path:
    """A fixed-size run without any coordinator (Paddle's plain way): the parity baseline."""
    log_dir = workdir / "logs"
    ports = [free_port() for _ in range(world_size)]
    procs = []
    for rank in range(world_size):
        env = {**os.environ, **gloo_env(rank, ports)}
        workdir.mkdir(parents=True, exist_ok=True)
        out = open(workdir / f"ref-rank{rank}.log", "ab")  # noqa: SIM115
        procs.append(
            template.popen(
                [
                    sys.executable,
                    example,
                    "--ckpt-dir",
                    str(workdir / "ckpt"),
                    "--log-dir",
                    str(log_dir),
                    *train_args,
                ],
                cwd=str(ROOT),
                env=env,
                stdout=out,
                stderr=out,
            )
        )
        out.close()
    codes = [p.wait(timeout=timeout_s) for p in procs]
    if any(codes):
        raise RuntimeError(f"reference run failed with {codes}; see {workdir}")
    return log_dir


def gloo_env(rank: int, ports: Sequence[int]) -> dict[str, str]:
    """The PADDLE_* environment of ``rank`` in a gloo group on loopback, one port a rank
    (rank 0's is the master): Paddle's plain way, with no launcher."""
    return {
        "PADDLE_DISTRI_BACKEND": "gloo",
        "PADDLE_MASTER": f"127.0.0.1:{ports[0]}",
        "PADDLE_TRAINER_ID": str(rank),
        "PADDLE_TRAINERS_NUM": str(len(ports)),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(f"127.0.0.1:{p}" for p in ports),
        "PADDLE_CURRENT_ENDPOINT": f"127.0.0.1:{ports[rank]}",
    }


def _past(step: int) -> Callable[[pb.JobStatus], bool]:
    return lambda s: s.step >= step


@dataclass
class Chain:
    """What :func:`resize_along` saw: each completed resize's final progress (the first
    forms generation 1), the aborted tries, and the coordinator's count of lost steps."""

    completed: list[pb.ResizeProgress] = field(default_factory=list)
    aborted: list[pb.ResizeProgress] = field(default_factory=list)
    lost_steps: int = 0


async def resize_along(
    job: LocalJob, worlds: Sequence[int], steps_between: int = 3, tries: int = 3
) -> Chain:
    """Start ``job``'s coordinator and pods, form its first generation at ``worlds[0]`` and
    resize it along the rest while it trains (``steps_between`` steps at each size), then
    wait for every pod to finish. A job with ``step_gate`` waits for each resize after its
    ``steps_between`` steps, so every resize lands mid-run; one without may finish first.
    An ABORTED resize (a barrier missed: on a loaded machine a worker can pass the
    checkpoint step before its directive comes) is tried again, as the scaler's next
    decision would, up to ``tries`` times. The pods a shrink removed are gone
    (as deleted pods are); the next grow's new ones start as soon as the shrink ended, so
    that they are warm by then. Raises when a resize does not complete or a pod fails."""
    job.start_coordinator()
    out = Chain()
    try:
        for i in range(max(worlds)):
            job.add_pod(i)
        await job.wait_standby(max(worlds), timeout_s=120)
        at, world = 0, 0
        for n, target in enumerate(worlds):
            if n:
                what = f"{steps_between} more steps"
                at = (await job.train_to(at + steps_between, 120, what)).step
            await job.wait_standby(target - world, timeout_s=120)
            for _ in range(tries):
                final = (await job.resize(target))[-1]
                if final.phase != pb.RESIZE_PHASE_ABORTED:
                    break
                out.aborted.append(final)
            if final.phase != pb.RESIZE_PHASE_COMPLETED:
                raise RuntimeError(f"resize to {target}: {final}")
            out.completed.append(final)
            world = target
            if job.step_gate:
                # A gated job waits a step past the barrier's: its steps here count from it.
                # (An ungated job keeps the pace the benches measured with.)
                at = max(at, final.checkpoint_step)
            ahead = worlds[n + 1] - world if n + 1 < len(worlds) else 0
            st = await job.status()
            standby = sum(m.state == pb.MEMBER_STATE_STANDBY for m in st.members) if st else 0
            for _ in range(ahead - standby):
                job.add_pod(len(job.pods))
        job.release()
        codes = await job.wait_pods_exit(300)
        if any(codes):
            raise RuntimeError(f"pods exited {codes}; see {job.workdir}")
        final_status = await job.status()
        if final_status is None:
            raise RuntimeError(f"the coordinator did not answer at the end; see {job.workdir}")
        out.lost_steps = final_status.lost_steps_total
    finally:
        await job.close()
    return out
