"""The local actuator: a job's "pods" are trainer launcher processes on this machine.

Same contract as every actuator (tide.services.scaler.actuators.base.Actuator):

- pod ``i`` of job ``ns/name`` is a launcher named ``name-trainer-i`` started
  with ``--pod-index i`` and a fresh uid (``POD_UID``, as the Downward API
  gives a real pod); a job with n replicas runs n pods, 0..n-1 unless a named
  pod was removed (``remove_pods``: a preempted node's pod), after which the
  gap stays until a grow fills the lowest free index again;
- ``set_replicas(job, n)`` is idempotent: it makes the job's wanted pods run
  (starting missing or dead ones, as a ReplicaSet would) and stops the others,
  highest index first; the wanted indexes are kept in ``indexes`` beside
  ``replicas``;
- everything lives under the state dir, so a restarted scaler finds the
  launchers it started before: each pod has a pid file holding the pid and the
  kernel's start time of the process, which tells a live launcher from a
  recycled pid.

Launchers run in their own session (process group), so they outlive the
scaler that started them (like pods outlive a controller) and a Ctrl-C in the
scaler's terminal reaches only the supervisor, which stops them in order.

A job's launch command comes from its spec file, ``jobs/<ns>__<name>/spec.json``,
written by whoever defines the job (`tide demo`, a user): ``{"command": [...],
"env": {...}, "gpus_per_replica": 1}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tide.base.credentials import CLIENT_ENV
from tide.base.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound
from tide.services.common.clock import Clock, SystemClock
from tide.services.common.files import write_atomic
from tide.services.scaler.actuators.base import check_still_leading

logger = logging.getLogger(__name__)

LAUNCHER = (sys.executable, "-m", "tide.trainer.launch")


@dataclass(frozen=True)
class LocalActuatorSettings:
    """Where local pods live and how they are started and stopped."""

    state_dir: Path
    # HOST:PORT of the coordinator every launcher registers with.
    coordinator: str
    # The launcher program; the pod's flags and `-- <job command>` follow it.
    launcher: tuple[str, ...] = LAUNCHER
    # GPUs this machine offers to jobs; None: unknown (free_gpus answers None).
    total_gpus: int | None = None
    # How long a pod asked to stop (SIGTERM) gets before SIGKILL, seconds. The
    # launcher stops its worker within its own exit grace, so a few seconds do.
    stop_grace_s: float = 10.0
    # How often a stop polls for the process to be gone, seconds.
    poll_interval_s: float = 0.05
    # A CA directory (ca.pem, ca-key.pem; tide.services.common.pki): each pod's launcher gets
    # a certificate of its own pod of its job and dials the coordinator with mTLS.
    # None: launchers dial without TLS (a coordinator run --insecure).
    ca_dir: Path | None = None

    def __post_init__(self) -> None:
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"coordinator: expected HOST:PORT, got {self.coordinator!r}")
        if not self.launcher:
            raise ConfigError("launcher: must name a program, got an empty command")
        if self.total_gpus is not None and self.total_gpus < 0:
            raise ConfigError(f"total_gpus: must be >= 0, got {self.total_gpus}")
        if not self.stop_grace_s >= 0:
            raise ConfigError(f"stop_grace_s: must be >= 0, got {self.stop_grace_s}")
        if not self.poll_interval_s > 0:
            raise ConfigError(f"poll_interval_s: must be > 0, got {self.poll_interval_s}")


@dataclass(frozen=True)
class JobSpec:
    """How to run one trainer of a job (what a PaddleJob's pod template says)."""

    command: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    gpus_per_replica: int = 1
    cwd: str = ""

    def __post_init__(self) -> None:
        if not self.command:
            raise ConfigError("command: a job spec needs the training command")
        if self.gpus_per_replica < 1:
            raise ConfigError(f"gpus_per_replica: must be >= 1, got {self.gpus_per_replica}")


@dataclass(frozen=True)
class Pod:
    """A launcher process this actuator started (now or in an earlier life)."""

    job_id: str
    index: int
    name: str
    pid: int
    # Kernel start time (clock ticks since boot): with the pid, identifies the process.
    start_ticks: int
    # The pod's uid (POD_UID), new at every start; "" in a pid file from before uids.
    uid: str = ""


def _resize_indexes(indexes: set[int], replicas: int) -> set[int]:
    """``indexes`` grown by the lowest free ones or cut from the highest, to ``replicas``."""
    out = set(indexes)
    for i in sorted(out, reverse=True)[: max(0, len(out) - replicas)]:
        out.discard(i)
    i = 0
    while len(out) < replicas:
        out.add(i)
        i += 1
    return out


def job_dir_name(job_id: str) -> str:
    ns, sep, name = job_id.partition("/")
    if not sep or not ns or not name or "/" in name or name in {".", ".."} or ns in {".", ".."}:
        raise InvalidArgument(f"job_id must be 'namespace/name', got {job_id!r}")
    return f"{ns}__{name}"


def pod_name(job_id: str, index: int) -> str:
    return f"{job_id.partition('/')[2]}-trainer-{index}"


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in ticks) of a process, None if there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name is in parentheses and may contain spaces; fields follow the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[19])


def is_running(pid: int, start_ticks: int) -> bool:
    """True when ``pid`` is the same process (not a recycled pid) and not a zombie."""
    stat = _proc_stat(pid)
    return stat is not None and stat[1] == start_ticks and stat[0] not in ("Z", "X")


class LocalActuator:
    """Implements tide.services.scaler.actuators.Actuator with launcher processes."""

    def __init__(self, settings: LocalActuatorSettings, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SystemClock()
        self._children: dict[int, subprocess.Popen[bytes]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        (settings.state_dir / "jobs").mkdir(parents=True, exist_ok=True)
        (settings.state_dir / "logs").mkdir(parents=True, exist_ok=True)

    # --- files ---

    def job_dir(self, job_id: str) -> Path:
        return self.settings.state_dir / "jobs" / job_dir_name(job_id)

    def write_spec(self, job_id: str, spec: JobSpec) -> None:
        d = self.job_dir(job_id)
        (d / "pods").mkdir(parents=True, exist_ok=True)
        doc = {
            "command": list(spec.command),
            "env": dict(spec.env),
            "gpus_per_replica": spec.gpus_per_replica,
            "cwd": spec.cwd,
        }
        write_atomic(d / "spec.json", json.dumps(doc, indent=2).encode(), sync=True)

    def read_spec(self, job_id: str) -> JobSpec:
        path = self.job_dir(job_id) / "spec.json"
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise NotFound(f"job {job_id}: no local job spec at {path}") from None
        except (OSError, ValueError) as exc:
            raise FailedPrecondition(f"job {job_id}: unreadable job spec {path}: {exc}") from None
        return JobSpec(
            command=tuple(doc["command"]),
            env=dict(doc.get("env", {})),
            gpus_per_replica=int(doc.get("gpus_per_replica", 1)),
            cwd=str(doc.get("cwd", "")),
        )

    def jobs(self) -> list[str]:
        out = []
        for d in sorted((self.settings.state_dir / "jobs").iterdir()):
            if (d / "spec.json").exists() and "__" in d.name:
                ns, _, name = d.name.partition("__")
                out.append(f"{ns}/{name}")
        return out

    def _pid_file(self, job_id: str, index: int) -> Path:
        return self.job_dir(job_id) / "pods" / f"{index}.json"

    def pods(self, job_id: str) -> list[Pod]:
        """Live pods of the job, by index; pid files of dead ones are removed."""
        self._reap()
        pods_dir = self.job_dir(job_id) / "pods"
        if not pods_dir.is_dir():
            return []
        out = []
        for f in pods_dir.glob("*.json"):
            try:
                doc: dict[str, Any] = json.loads(f.read_text())
                pod = Pod(
                    job_id,
                    int(doc["index"]),
                    doc["name"],
                    int(doc["pid"]),
                    int(doc["start"]),
                    str(doc.get("uid", "")),
                )
            except (OSError, ValueError, KeyError) as exc:
                logger.warning(
                    "job %s: ignoring damaged pid file %s: %s",
                    job_id,
                    f,
                    exc,
                    extra={"job_id": job_id},
                )
                f.unlink(missing_ok=True)
                continue
            if is_running(pod.pid, pod.start_ticks):
                out.append(pod)
            else:
                logger.info(
                    "job %s: pod %s (pid %d) is gone",
                    job_id,
                    pod.name,
                    pod.pid,
                    extra={"job_id": job_id},
                )
                f.unlink(missing_ok=True)
        return sorted(out, key=lambda p: p.index)

    def _reap(self) -> None:
        """Collect exit statuses of our own children, so they do not linger as zombies."""
        for pid, proc in list(self._children.items()):
            if proc.poll() is not None:
                del self._children[pid]

    # --- the Actuator protocol ---

    def adopt(self, job_id: str, *, replicas: int, gpus_per_replica: int) -> None:
        # The job's spec file and replicas file under the state dir are this
        # actuator's own record (they outlive the scaler); nothing to learn.
        return None

    async def set_replicas(self, job_id: str, replicas: int, *, decision_id: int) -> None:
        await self.remove_pods(job_id, (), replicas=replicas, decision_id=decision_id)

    async def remove_pods(
        self, job_id: str, pods: Sequence[str], *, replicas: int, decision_id: int
    ) -> None:
        if replicas < 0:
            raise InvalidArgument(f"job {job_id}: replicas must be >= 0, got {replicas}")
        spec = self.read_spec(job_id)
        lock = self._locks.setdefault(job_id, asyncio.Lock())
        async with lock, self._job_file_lock(job_id):
            # Under the job's lock, as late as it can be before the writes.
            check_still_leading(job_id, decision_id)
            live = {p.index: p for p in self.pods(job_id)}
            named = set(pods)
            doomed = {i for i, p in live.items() if p.name in named or (p.uid and p.uid in named)}
            before = self._wanted(job_id)
            # A named pod that died already (its node went first, or its launcher left on
            # SIGTERM) leaves its index too; its pid file went with it, so it is found by
            # the name the decision carries beside its uid (leaving_pod_names).
            doomed |= {i for i in before - live.keys() if pod_name(job_id, i) in named}
            wanted = _resize_indexes(before - doomed, replicas)
            # The wanted pods are written first: a scaler that dies half-way
            # comes back knowing what it was asked for.
            write_atomic(
                self.job_dir(job_id) / "indexes", json.dumps(sorted(wanted)).encode(), sync=True
            )
            write_atomic(self.job_dir(job_id) / "replicas", f"{replicas}\n".encode(), sync=True)
            for index in sorted(wanted):
                if index not in live:
                    self._start(job_id, index, spec, decision_id)
            for index in sorted((i for i in live if i not in wanted), reverse=True):
                await self._stop(live[index])

    def _wanted(self, job_id: str) -> set[int]:
        """The indexes the job is asked to run: 0..replicas-1 but for removed pods."""
        d = self.job_dir(job_id)
        try:
            replicas = int((d / "replicas").read_text())
        except (FileNotFoundError, ValueError):
            return set()
        try:
            got = {int(i) for i in json.loads((d / "indexes").read_text())}
        except (FileNotFoundError, ValueError, TypeError):
            got = set(range(replicas))
        # A replicas file written by an older actuator, or by hand, wins over the list.
        return _resize_indexes(got, replicas)

    @contextlib.asynccontextmanager
    async def _job_file_lock(self, job_id: str) -> AsyncIterator[None]:
        """Across processes (the scaler's actuator, `tide up` stopping pods, a restarted
        scaler next to a dying one): one changes a job's pods at a time. The kernel
        drops the lock when its holder dies, so a crash never leaves it stuck."""
        path = self.job_dir(job_id) / "pods.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    # Polled, not a blocking flock: the event loop keeps serving.
                    await self.clock.sleep(self.settings.poll_interval_s)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    async def get_replicas(self, job_id: str) -> int | None:
        try:
            return int((self.job_dir(job_id) / "replicas").read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            logger.warning(
                "job %s: unreadable replicas file; counting live pods",
                job_id,
                extra={"job_id": job_id},
            )
            return len(self.pods(job_id))

    async def free_gpus(self) -> int | None:
        if self.settings.total_gpus is None:
            return None
        used = 0
        for job_id in self.jobs():
            n = await self.get_replicas(job_id) or 0
            used += n * self.read_spec(job_id).gpus_per_replica
        return max(0, self.settings.total_gpus - used)

    # --- processes ---

    def _start(self, job_id: str, index: int, spec: JobSpec, decision_id: int) -> Pod:
        name = pod_name(job_id, index)
        uid = str(uuid.uuid4())
        log_path = self.settings.state_dir / "logs" / f"{name}.log"
        argv = [
            *self.settings.launcher,
            "--coordinator",
            self.settings.coordinator,
            "--job",
            job_id,
            "--pod",
            name,
            "--pod-index",
            str(index),
            "--state-dir",
            str(self.settings.state_dir / "pods" / name),
            *self._credential_flags(job_id, name),
            "--",
            *spec.command,
        ]
        env = {
            # The scaler's own client credentials are not the pod's.
            **{k: v for k, v in os.environ.items() if k not in CLIENT_ENV},
            **spec.env,
            "POD_NAME": name,
            "POD_UID": uid,
            "TIDE_POD_INDEX": str(index),
            "TIDE_JOB_ID": job_id,
            "PYTHONUNBUFFERED": "1",
        }
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=spec.cwd or None,
                start_new_session=True,
            )
        stat = _proc_stat(proc.pid)
        start = stat[1] if stat else 0
        self._children[proc.pid] = proc
        doc = {
            "index": index,
            "name": name,
            "uid": uid,
            "pid": proc.pid,
            "start": start,
            "log": str(log_path),
        }
        write_atomic(self._pid_file(job_id, index), json.dumps(doc).encode(), sync=True)
        logger.info(
            "job %s: started pod %s (pid %d) for decision %d",
            job_id,
            name,
            proc.pid,
            decision_id,
            extra={"job_id": job_id, "decision_id": decision_id or None},
        )
        return Pod(job_id, index, name, proc.pid, start, uid)

    def _credential_flags(self, job_id: str, name: str) -> list[str]:
        if self.settings.ca_dir is None:
            return []
        from tide.services.common.pki import CertificateAuthority

        ca = CertificateAuthority(self.settings.ca_dir)
        issued = ca.launcher(job_id, name, directory=self.settings.state_dir / "pods" / name)
        return [
            "--tls-ca-file",
            ca.ca_file,
            "--tls-client-cert-file",
            issued.cert_file,
            "--tls-client-key-file",
            issued.key_file,
        ]

    async def _stop(self, pod: Pod) -> None:
        """SIGTERM to the launcher, SIGKILL after the grace; returns when it is gone.

        Like a kubelet, only the launcher is asked: it stops its worker in
        order. Whatever is left of its process group afterwards is killed."""
        logger.info(
            "job %s: stopping pod %s (pid %d)",
            pod.job_id,
            pod.name,
            pod.pid,
            extra={"job_id": pod.job_id},
        )
        if is_running(pod.pid, pod.start_ticks):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pod.pid, signal.SIGTERM)
        if not await self._wait_gone(pod, self.settings.stop_grace_s):
            logger.warning(
                "job %s: pod %s ignored SIGTERM for %.1f s; killing it",
                pod.job_id,
                pod.name,
                self.settings.stop_grace_s,
                extra={"job_id": pod.job_id},
            )
            self._kill_group(pod)
            await self._wait_gone(pod, 30.0)
        self._kill_group(pod)
        self._pid_file(pod.job_id, pod.index).unlink(missing_ok=True)

    @staticmethod
    def _kill_group(pod: Pod) -> None:
        # The launcher leads its own session, so its group id is its pid; the
        # group outlives the leader while any worker or zygote is left in it,
        # and the kernel does not hand out that pid again while the group
        # exists. So a process holding the pid with another start time means
        # our group is gone and the pid is someone else's: leave it alone.
        stat = _proc_stat(pod.pid)
        if stat is not None and stat[1] != pod.start_ticks:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pod.pid, signal.SIGKILL)

    async def _wait_gone(self, pod: Pod, timeout_s: float) -> bool:
        deadline = self.clock.monotonic() + timeout_s
        while True:
            self._reap()
            if not is_running(pod.pid, pod.start_ticks):
                return True
            if self.clock.monotonic() >= deadline:
                return False
            await self.clock.sleep(self.settings.poll_interval_s)

    async def stop_all(self, job_ids: Sequence[str] | None = None) -> None:
        """Stop every pod of the given jobs (all jobs by default), a job's pods at once.

        At once, not one by one: a worker whose peer was stopped first saw its collective
        break and died before its own launcher was told, which read as a crash (an
        ERROR, and lost steps recorded at a planned teardown); and one grace, not one per
        pod. The wanted replicas stay recorded, so a later start can bring the job back."""
        for job_id in job_ids if job_ids is not None else self.jobs():
            async with self._job_file_lock(job_id):
                pods = sorted(self.pods(job_id), key=lambda p: -p.index)  # signalled in this order
                await asyncio.gather(*(self._stop(pod) for pod in pods))
