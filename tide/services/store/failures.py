"""Which database errors mean what: retry the unit of work, the store is unavailable,
or a lost version race; and the ``cause`` label of each (tide/services/store/metrics.py).
tide/services/store/db.py retries and reports by them."""

from __future__ import annotations

from typing import Final

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm.exc import StaleDataError

from tide.base.errors import Conflict

# SQLSTATEs after which PostgreSQL guarantees the transaction had no effect and
# the same work may simply run again: serialization failure, deadlock, and
# lock_timeout expired.
_RETRYABLE_SQLSTATES: Final = frozenset({"40001", "40P01", "55P03"})
#: PostgreSQL shutting down or starting (admin_shutdown, crash_shutdown,
#: cannot_connect_now): the server is going or not yet back, nothing was done.
_UNAVAILABLE_SQLSTATES: Final = frozenset({"57P01", "57P02", "57P03"})
#: SQLite primary result codes of a store that cannot take writes at all (IOERR,
#: FULL, CANTOPEN, READONLY): the disk, not the request, is at fault.
_SQLITE_UNAVAILABLE_CODES: Final = frozenset({10, 13, 14, 8})


class StaleWrite(Conflict):
    """Another transaction changed the row (its version counter) since this one read it.

    Repositories raise it for SQLAlchemy's StaleDataError; :func:`unit_of_work`
    runs the work again, which re-reads the row.
    """


def is_retryable(exc: BaseException) -> bool:
    """True when the whole unit of work can run again and no effect of it remains.

    A dropped connection (the server restarted, the backend was terminated), a
    PostgreSQL serialization failure or deadlock, and SQLite's "database is
    locked" after busy_timeout all roll the transaction back entirely.
    """
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated or is_connection_failure(exc):
        return True
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None)
    if sqlstate in _RETRYABLE_SQLSTATES:
        return True
    # sqlite3 errors carry the extended result code; SQLITE_BUSY is 5 in the low byte.
    code = getattr(orig, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF == 5


def is_connection_failure(exc: BaseException) -> bool:
    """True when no connection to PostgreSQL could be had (refused, timed out, the
    server shutting down or starting): no statement ran, so retrying is safe, and
    past the retries the store is unavailable, not the request wrong."""
    if not isinstance(exc, OperationalError):
        return False
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate is None:
        # psycopg's connect errors carry no SQLSTATE; SQLite's errors are never
        # about a connection (they have their own codes, see is_store_unusable).
        return getattr(exc.orig, "sqlite_errorcode", None) is None
    return sqlstate.startswith("08") or sqlstate in _UNAVAILABLE_SQLSTATES


def is_store_unusable(exc: BaseException) -> bool:
    """True when SQLite cannot write at all (disk full, read-only, I/O error): not
    retried at once, but reported as the store being unavailable."""
    if not isinstance(exc, DBAPIError):
        return False
    code = getattr(exc.orig, "sqlite_errorcode", None)
    return isinstance(code, int) and code & 0xFF in _SQLITE_UNAVAILABLE_CODES


def failure_cause(exc: BaseException | None) -> str:
    """The ``cause`` label of a retried or failed unit of work (tide/services/store/metrics.py)."""
    if isinstance(exc, (StaleDataError, StaleWrite)):
        return "stale_write"
    if not isinstance(exc, DBAPIError):
        return "other"
    if exc.connection_invalidated:
        return "connection_lost"
    if is_connection_failure(exc):
        return "connection_failed"
    if is_store_unusable(exc):
        return "store_unusable"
    sqlstate = getattr(exc.orig, "sqlstate", None)
    if sqlstate == "40001":
        return "serialization_failure"
    if sqlstate == "40P01":
        return "deadlock"
    code = getattr(exc.orig, "sqlite_errorcode", None)
    if isinstance(code, int) and code & 0xFF == 5:
        return "busy"
    return "other"
