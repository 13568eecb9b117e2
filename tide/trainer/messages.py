"""The typed messages between a launcher and its worker, and their one wire format.

Each message is a frozen dataclass; on the control socket it is one JSON object per line
with a ``type`` naming the class (``{"type": "progress", "step": 12, ...}``). Both ends
are the same Tide version (the launcher forks the worker), so the format is private to
this module; :func:`encode` and the two decoders are the only code that sees the dicts.

Launcher → worker (:data:`ToWorker`): :class:`Rendezvous` (to a prewarmed worker),
:class:`CheckpointAt`, :class:`Hold`, :class:`Resume`, :class:`Exit`.

Worker → launcher (:data:`ToLauncher`): :class:`Hello`, :class:`Ready`, :class:`Progress`,
:class:`Held`, :class:`Resumed`, :class:`CheckpointWritten`, :class:`Done`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

M = TypeVar("M", bound="_Message")

# The field annotations this module uses for scalar fields, and how a decoded value is coerced.
_SCALARS: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}


class MessageError(ValueError):
    """A line that is not a message of this direction (bad JSON, unknown type, bad field)."""


@dataclass(frozen=True)
class _Message:
    TYPE: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {"type": self.TYPE, **asdict(self)}

    @classmethod
    def from_json(cls: type[M], data: Mapping[str, Any]) -> M:
        """Scalar fields are coerced to their declared type; a missing one takes its
        default. Classes with structured fields override this."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            conv = _SCALARS.get(str(f.type))
            kwargs[f.name] = conv(data[f.name]) if conv is not None else data[f.name]
        return cls(**kwargs)


# -- launcher → worker ------------------------------------------------------------------------


@dataclass(frozen=True)
class Rendezvous(_Message):
    """A prewarmed worker's generation: the PADDLE_*/TIDE_* environment it joins with."""

    TYPE: ClassVar[str] = "rendezvous"
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Rendezvous:
        env = data.get("env") or {}
        if not isinstance(env, Mapping):
            raise MessageError(f"rendezvous env must be an object, got {env!r}")
        return cls(env={str(k): str(v) for k, v in env.items()})


@dataclass(frozen=True)
class Start(_Message):
    """Overlap mode: a prepared worker (its group of the generation formed ahead) restores
    now (a stayer's at its pod's hold, a newcomer's once prepared) and waits for :class:`Go`;
    ``env`` has the restore step."""

    TYPE: ClassVar[str] = "start"
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Start:
        env = data.get("env") or {}
        if not isinstance(env, Mapping):
            raise MessageError(f"start env must be an object, got {env!r}")
        return cls(env={str(k): str(v) for k, v in env.items()})


@dataclass(frozen=True)
class Go(_Message):
    """Overlap mode: the barrier completed (the coordinator's RENDEZVOUS); a prepared
    worker that restored trains from here; ``env`` has the restart's start time."""

    TYPE: ClassVar[str] = "go"
    env: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Go:
        env = data.get("env") or {}
        if not isinstance(env, Mapping):
            raise MessageError(f"go env must be an object, got {env!r}")
        return cls(env={str(k): str(v) for k, v in env.items()})


@dataclass(frozen=True)
class CheckpointAt(_Message):
    """Stop after ``step`` (every rank at the same one), checkpoint it, hold."""

    TYPE: ClassVar[str] = "checkpoint"
    directive_id: str = ""
    step: int = 0
    # This pod leaves after the barrier: no next worker to hand the state to.
    leaving: bool = False


@dataclass(frozen=True)
class Hold(_Message):
    """Stop at the current step boundary and hold (no checkpoint)."""

    TYPE: ClassVar[str] = "hold"
    directive_id: str = ""


@dataclass(frozen=True)
class Resume(_Message):
    """Carry on in the same process after a hold."""

    TYPE: ClassVar[str] = "resume"
    directive_id: str = ""


@dataclass(frozen=True)
class Exit(_Message):
    """Leave now (the launcher SIGKILLs a worker that does not, after its grace)."""

    TYPE: ClassVar[str] = "exit"


ToWorker = Rendezvous | Start | Go | CheckpointAt | Hold | Resume | Exit


# -- worker → launcher ------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello(_Message):
    """First line of every worker: which process this connection speaks for."""

    TYPE: ClassVar[str] = "hello"
    pid: int = -1
    generation: int = 0


@dataclass(frozen=True)
class Ready(_Message):
    """The worker has its process group and restored ``restored_step``."""

    TYPE: ClassVar[str] = "ready"
    restored_step: int = 0
    generation: int = 0
    worker_restart_s: float = 0.0
    group_init_s: float = 0.0
    restore_s: float = 0.0


@dataclass(frozen=True)
class Prepared(_Message):
    """Overlap mode: a standby worker has the process group of ``generation`` (formed in
    ``group_init_s`` while the current worker trained) and waits for :class:`Start`."""

    TYPE: ClassVar[str] = "prepared"
    generation: int = 0
    group_init_s: float = 0.0


@dataclass(frozen=True)
class Progress(_Message):
    """After every step (and once after restore)."""

    TYPE: ClassVar[str] = "progress"
    step: int = 0
    epoch: int = 0
    cursor: int = 0
    samples_per_s: float = 0.0
    # Wall time of this generation's first completed step; 0.0 until then.
    first_step_at: float = 0.0


@dataclass(frozen=True)
class CheckpointInfo:
    """What rank 0 wrote at a hold: the step, its manifest digest and the write time."""

    step: int
    digest: str
    write_s: float


@dataclass(frozen=True)
class Held(_Message):
    """Every rank stopped after ``step``; ``checkpoint`` is set on rank 0 when one was asked."""

    TYPE: ClassVar[str] = "held"
    step: int = 0
    held_at: float = 0.0
    directive_ids: tuple[str, ...] = ()
    checkpoint: CheckpointInfo | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Held:
        ckpt = data.get("checkpoint")
        return cls(
            step=int(data.get("step", 0)),
            held_at=float(data.get("held_at", 0.0)),
            directive_ids=tuple(str(d) for d in data.get("directive_ids") or ()),
            checkpoint=(
                CheckpointInfo(int(ckpt["step"]), str(ckpt["digest"]), float(ckpt["write_s"]))
                if ckpt
                else None
            ),
        )


@dataclass(frozen=True)
class Resumed(_Message):
    TYPE: ClassVar[str] = "resumed"
    step: int = 0


@dataclass(frozen=True)
class CheckpointWritten(_Message):
    """Rank 0 committed and verified the checkpoint of ``step`` (periodic or coordinated)."""

    TYPE: ClassVar[str] = "checkpoint"
    step: int = 0
    digest: str = ""
    write_s: float = 0.0
    periodic: bool = False
    # From the snapshot of the state to the commit in the durable store, seconds: how far
    # the durable copy lagged the training (a background write waits its turn).
    lag_s: float = 0.0


@dataclass(frozen=True)
class Done(_Message):
    """The budget is trained (final checkpoint written); the worker exits 0 next."""

    TYPE: ClassVar[str] = "done"
    step: int = 0


ToLauncher = Hello | Ready | Prepared | Progress | Held | Resumed | CheckpointWritten | Done

_TO_WORKER: dict[str, type[_Message]] = {
    c.TYPE: c for c in (Rendezvous, Start, Go, CheckpointAt, Hold, Resume, Exit)
}
_TO_LAUNCHER: dict[str, type[_Message]] = {
    c.TYPE: c for c in (Hello, Ready, Prepared, Progress, Held, Resumed, CheckpointWritten, Done)
}


def encode(message: ToWorker | ToLauncher) -> bytes:
    """One line of the control socket."""
    return (json.dumps(message.to_json()) + "\n").encode()


def _decode(line: bytes | str, table: Mapping[str, type[_Message]], side: str) -> Any:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise MessageError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise MessageError(f"a message is a JSON object, got {type(data).__name__}")
    cls = table.get(str(data.get("type")))
    if cls is None:
        raise MessageError(f"unknown message type {data.get('type')!r} for the {side}")
    try:
        return cls.from_json(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise MessageError(f"bad {cls.TYPE} message: {exc}") from None


def decode_to_worker(line: bytes | str) -> ToWorker:
    """A line the launcher sent, as its message; :class:`MessageError` if it is none."""
    msg: ToWorker = _decode(line, _TO_WORKER, "worker")
    return msg


def decode_to_launcher(line: bytes | str) -> ToLauncher:
    """A line a worker sent, as its message; :class:`MessageError` if it is none."""
    msg: ToLauncher = _decode(line, _TO_LAUNCHER, "launcher")
    return msg
