"""Tide's log lines: one convention for every process (services and the trainer launcher).

Ids are fields, not words in a message. Code that works on a job, a decision, a
node or a member binds the ids for the scope of that work::

    with logs.bound(job_id=job.job_id, decision_id=d.id):
        ...                       # every line logged here, in this task and in
                                  # the tasks it starts, carries both ids

or, at the top of a task that works on one thing for its whole life,
``logs.bind(job_id=...)``. A single line may also pass them as
``extra={"job_id": ...}``; a value given there wins over a bound one.

The binding lives in a :mod:`contextvars` variable, so asyncio tasks (which
copy the context when they are created) and ``asyncio.to_thread`` inherit it,
and two tasks never see each other's ids.

Formats: ``text`` (for people) appends the ids as ``key=value`` after the
message; ``json`` (for collectors) writes one object per line with the ids as
top-level keys. Both write times as RFC 3339 in UTC with milliseconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator, Mapping, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, Final

#: The id fields, in the order a text line shows them.
CONTEXT_KEYS: Final = ("job_id", "decision_id", "node", "member", "generation")

#: Libraries whose INFO lines are start-up chatter (Alembic prints two per start).
QUIET_LOGGERS: Final = ("alembic", "alembic.runtime.migration")

# Read-only, so the shared default can never be changed in place.
_context: ContextVar[Mapping[str, Any]] = ContextVar(
    "tide_log_context", default=MappingProxyType({})
)


_KEYS: Final = frozenset(CONTEXT_KEYS)


def _clean(ids: Mapping[str, Any]) -> dict[str, Any]:
    # One subset test, no set built: the scaler binds a job id around every job of
    # every 1 s pass.
    if not ids.keys() <= _KEYS:
        # A typo (job=, member_id=) would silently drop the id from every line.
        unknown = sorted(set(ids) - _KEYS)
        raise TypeError(f"unknown log context keys {unknown}; use {CONTEXT_KEYS}")
    return {k: v for k, v in ids.items() if v is not None and v != ""}


@contextmanager
def bound(**ids: Any) -> Iterator[None]:
    """Bind ``ids`` to every log line of the block (and of the tasks started in it)."""
    token = _context.set({**_context.get(), **_clean(ids)})
    try:
        yield
    finally:
        # The block may end in another context than it began: an async generator (a
        # streaming RPC) that its caller dropped is closed by the loop's finalizer in a
        # task of its own. That context never held the ids: nothing to restore, and
        # raising there was "Task exception was never retrieved" after a failed call.
        with contextlib.suppress(ValueError):
            _context.reset(token)


def bind(**ids: Any) -> None:
    """Bind ``ids`` for the rest of the current context: a task's, or the process's
    main one before it starts its tasks."""
    _context.set({**_context.get(), **_clean(ids)})


#: Ids of the whole process (an agent's node; a launcher's job and, once it has
#: registered, its member id), under the bound ones.
_process: dict[str, Any] = {}


def bind_process(**ids: Any) -> None:
    """Ids every line of this process carries, set (or changed) at any time: for a
    process that serves one node or one member, learned after its tasks started."""
    _process.update(_clean(ids))


def current() -> Mapping[str, Any]:
    """The ids a line logged here would carry."""
    return {**_process, **_context.get()}


class ContextFilter(logging.Filter):
    """Copies the bound ids onto each record (an id given in ``extra`` wins)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in current().items():
            if getattr(record, key, None) is None:
                setattr(record, key, value)
        return True


def rfc3339(created: float) -> str:
    """``2026-12-03T06:40:00.123Z``: the one time format of Tide's logs (and CLI)."""
    return (
        datetime.fromtimestamp(created, tz=UTC)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


def _ids(record: logging.LogRecord) -> dict[str, Any]:
    out = {}
    for key in CONTEXT_KEYS:
        value = getattr(record, key, None)
        if value is not None:
            out[key] = value
    return out


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time``, ``level``, ``logger``, ``msg``, the ids, ``exc``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": rfc3339(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
            **_ids(record),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """``TIME LEVEL logger: message key=value ...``, the ids last so grep finds them."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{rfc3339(record.created)} {record.levelname} {record.name}: {record.getMessage()}"
        ids = _ids(record)
        if ids:
            line += " " + " ".join(f"{k}={v}" for k, v in ids.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


FORMATS: Final = ("text", "json")


def configure(level: str = "INFO", fmt: str = "text", stream: Any = None) -> None:
    """Route every logger to one handler on stderr (or ``stream``) in ``fmt``."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {FORMATS}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Alembic says the same two INFO lines on every start: shown only under DEBUG.
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(
            logging.NOTSET if root.level <= logging.DEBUG else logging.WARNING
        )


class ContextAdapter(logging.LoggerAdapter[logging.Logger]):
    """A logger that always carries some ids (an object that lives for one job or node)."""

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**dict(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


def with_context(logger: logging.Logger, **ids: Any) -> ContextAdapter:
    return ContextAdapter(logger, _clean(ids))
