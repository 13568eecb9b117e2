"""The SQL store shared by the scaler and the coordinator: engine, sessions, retries, migrations.

SQLite is the embedded default and PostgreSQL the production store; both go
through :func:`make_engine`, so every service gets the same durability and
locking settings. Sessions are opened at the edge with :func:`session_scope`
or :func:`unit_of_work`; repository functions take the session as their first
argument and never commit themselves.
"""

from __future__ import annotations

import json
import logging
import math
import random
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, TypeVar

from sqlalchemy import DateTime, Engine, MetaData, create_engine, event, make_url
from sqlalchemy.engine import URL, Connection, Dialect
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker
from sqlalchemy.orm.exc import StaleDataError
from sqlalchemy.pool import ConnectionPoolEntry
from sqlalchemy.types import TypeDecorator
from tenacity import RetryCallState, RetryError, Retrying, retry_if_exception, stop_after_attempt

from tide.base.errors import ConfigError, InvalidArgument, StoreUnavailable, Unavailable
from tide.services.common.gil import SWITCH
from tide.services.store import metrics as store_metrics
from tide.services.store.failures import (
    StaleWrite as StaleWrite,  # re-exported: db.StaleWrite is what callers name
)
from tide.services.store.failures import (
    failure_cause,
    is_retryable,
    is_store_unusable,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

# The execution option our SQLite "begin" hook reads to choose the BEGIN flavour.
_BEGIN_OPTION: Final = "tide_sqlite_begin"


# Deterministic constraint names: Alembic can only drop or alter a named
# constraint, and SQLite batch migrations need the names to rebuild tables.
NAMING_CONVENTION: Final = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    """Declarative base of every table; ``Base.metadata`` is what Alembic compares against."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class UTCDateTime(TypeDecorator[datetime]):
    """A timestamp that is always timezone-aware UTC in Python, whatever the database.

    SQLite has no time zone type and SQLAlchemy's SQLite DATETIME drops tzinfo
    silently, so an aware local time would be stored as if it were UTC. Values
    are normalised to UTC here, and naive datetimes are refused instead of
    guessed at. Stored as ``timestamptz`` on PostgreSQL.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError(f"naive datetime {value!r} given to a UTC column; attach tzinfo")
        value = value.astimezone(UTC)
        # SQLite stores text; keeping one fixed format (no offset) keeps ORDER BY
        # and range comparisons on that text chronological.
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


def utc_from_epoch(seconds: float) -> datetime:
    """A Clock's ``now()`` as the aware UTC datetime the store expects."""
    return datetime.fromtimestamp(seconds, tz=UTC)


@dataclass(frozen=True)
class DbSettings:
    """Tunables of the engine. The URL travels separately; these rarely change."""

    # How long a SQLite writer waits for the write lock before "database is locked".
    busy_timeout_s: float = 5.0
    # PostgreSQL connection pool size and overflow per process.
    pool_size: int = 5
    max_overflow: int = 5
    # Connections older than this are replaced, so a server-side idle timeout
    # or a NAT drop never hands us a dead socket twice.
    pool_recycle_s: float = 1800.0
    # PostgreSQL TCP connect timeout.
    connect_timeout_s: float = 5.0
    # Time a pool checkout may wait for a free connection.
    pool_timeout_s: float = 10.0
    # PostgreSQL: a statement waiting this long for a row lock fails (and the
    # unit of work retries) instead of hanging a scaler thread behind a stuck
    # transaction; and a session idle inside a transaction this long is ended
    # by the server, releasing its locks. 0 disables either.
    lock_timeout_s: float = 10.0
    # Short: a process paused mid-transaction (SIGSTOP, a frozen VM) holds its row
    # locks until the server ends its session, and a new leader taking the jobs
    # waits on them (docs/reliability.md, T08); our transactions take milliseconds.
    idle_in_transaction_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not (0 < self.busy_timeout_s <= 600):
            raise ConfigError(f"busy_timeout_s must be in (0, 600], got {self.busy_timeout_s}")
        if self.pool_size < 1:
            raise ConfigError(f"pool_size must be >= 1, got {self.pool_size}")
        if self.max_overflow < 0:
            raise ConfigError(f"max_overflow must be >= 0, got {self.max_overflow}")
        if self.pool_recycle_s <= 0:
            raise ConfigError(f"pool_recycle_s must be > 0, got {self.pool_recycle_s}")
        if not (0 < self.connect_timeout_s <= 300):
            raise ConfigError(
                f"connect_timeout_s must be in (0, 300], got {self.connect_timeout_s}"
            )
        if self.pool_timeout_s <= 0:
            raise ConfigError(f"pool_timeout_s must be > 0, got {self.pool_timeout_s}")
        if self.lock_timeout_s < 0:
            raise ConfigError(f"lock_timeout_s must be >= 0, got {self.lock_timeout_s}")
        if self.idle_in_transaction_timeout_s < 0:
            raise ConfigError(
                "idle_in_transaction_timeout_s must be >= 0, "
                f"got {self.idle_in_transaction_timeout_s}"
            )


def _finite(obj: Any) -> Any:
    """Replace NaN and infinities by None: PostgreSQL's json type rejects them.

    Window buckets without samples are NaN (see WindowStats in common.proto);
    JSON null says the same thing and reads back on both engines.
    """
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


def json_dumps(obj: Any) -> str:
    """The JSON serializer of every engine: compact, and never NaN."""
    return json.dumps(_finite(obj), allow_nan=False, separators=(",", ":"), sort_keys=True)


def parse_url(url: str) -> URL:
    try:
        return make_url(url)
    except Exception as exc:  # sqlalchemy raises ArgumentError with a vague text
        raise ConfigError(f"database url {url!r} is not a valid SQLAlchemy URL: {exc}") from exc


def make_engine(url: str, settings: DbSettings | None = None) -> Engine:
    """An engine for a ``sqlite:///path`` or ``postgresql+psycopg://`` URL with Tide's settings.

    SQLite: WAL, synchronous=FULL, busy_timeout, foreign keys on, and BEGIN
    emitted by us (IMMEDIATE for write sessions, see :func:`session_scope`).
    PostgreSQL: pool_pre_ping, recycled connections, a connect timeout.
    """
    settings = settings or DbSettings()
    parsed = parse_url(url)
    backend = parsed.get_backend_name()
    if backend == "sqlite":
        return _sqlite_engine(parsed, settings)
    if backend == "postgresql":
        if parsed.get_driver_name() != "psycopg":
            raise ConfigError(
                f"database url {parsed.render_as_string(hide_password=True)!r}: "
                "use the psycopg 3 driver (postgresql+psycopg://)"
            )
        return _postgres_engine(parsed, settings)
    raise ConfigError(
        f"database url {parsed.render_as_string(hide_password=True)!r}: "
        f"backend {backend!r} is not supported (sqlite or postgresql+psycopg)"
    )


def _postgres_engine(url: URL, settings: DbSettings) -> Engine:
    engine = create_engine(
        url,
        pool_pre_ping=True,
        pool_size=settings.pool_size,
        max_overflow=settings.max_overflow,
        pool_recycle=settings.pool_recycle_s,
        pool_timeout=settings.pool_timeout_s,
        json_serializer=json_dumps,
        connect_args={
            "connect_timeout": max(1, math.ceil(settings.connect_timeout_s)),
            "application_name": "tide",
        },
    )
    timeouts = (
        ("lock_timeout", settings.lock_timeout_s),
        ("idle_in_transaction_session_timeout", settings.idle_in_transaction_timeout_s),
    )

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        # Session settings outside any transaction, so that the pool's first
        # rollback cannot undo them.
        autocommit = dbapi_connection.autocommit
        dbapi_connection.autocommit = True
        try:
            with dbapi_connection.cursor() as cursor:
                for name, seconds in timeouts:
                    cursor.execute(f"SET {name} = {int(seconds * 1000)}")
        finally:
            dbapi_connection.autocommit = autocommit

    return engine


def _sqlite_engine(url: URL, settings: DbSettings) -> Engine:
    database = url.database or ""
    in_memory = database in ("", ":memory:") or database.startswith("file::memory:")
    if not in_memory:
        Path(database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, json_serializer=json_dumps)
    busy_ms = int(settings.busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: ConnectionPoolEntry) -> None:
        # Take BEGIN away from the sqlite3 driver (it defers it to the first DML,
        # which breaks repeatable reads and savepoints); our "begin" hook emits it.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            # A fixed busy timeout instead of the driver's default 5 s, set first so
            # that the pragmas below already wait rather than fail.
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            if not in_memory:
                _ensure_wal(cursor, settings.busy_timeout_s)
            # FULL fsyncs the WAL on every commit: a decision reported committed
            # survives a power loss, not only a process crash (NORMAL does not).
            cursor.execute("PRAGMA synchronous = FULL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(_BEGIN_OPTION, "DEFERRED")
        # IMMEDIATE takes the write lock at BEGIN, waiting under busy_timeout; a
        # deferred transaction that read first and then writes gets SQLITE_BUSY
        # at once when another writer committed meanwhile, busy_timeout or not.
        conn.exec_driver_sql("BEGIN IMMEDIATE" if mode == "IMMEDIATE" else "BEGIN")

    return engine


def _ensure_wal(cursor: Any, busy_timeout_s: float) -> None:
    """Switch the file to WAL (persistent), which lets readers run beside the one writer.

    The switch needs an exclusive lock and SQLite answers "database is locked"
    at once instead of calling the busy handler, e.g. when two services open a
    new database together; so poll until busy_timeout.
    """
    if str(cursor.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
        return
    deadline = time.monotonic() + busy_timeout_s
    while True:
        try:
            mode = cursor.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)
            continue
        if str(mode).lower() != "wal":
            raise ConfigError(
                f"SQLite refused journal_mode=WAL (got {mode!r}); is it a network FS?"
            )
        return


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions whose objects stay readable after commit (repositories copy them out anyway)."""
    return sessionmaker(bind=engine, expire_on_commit=False)


@contextmanager
def session_scope(
    factory: sessionmaker[Session], *, write: bool = True, isolation_level: str | None = None
) -> Iterator[Session]:
    """One transaction: commit when the block ends, roll back when it raises.

    ``write=True`` begins SQLite transactions with BEGIN IMMEDIATE, so a
    transaction that reads and then writes cannot fail on lock upgrade; pass
    ``write=False`` for read-only work so readers never queue behind writers.
    ``isolation_level`` applies to PostgreSQL (e.g. "SERIALIZABLE").
    """
    options: dict[str, Any] = {_BEGIN_OPTION: "IMMEDIATE" if write else "DEFERRED"}
    if isolation_level is not None:
        options["isolation_level"] = isolation_level
    with factory(execution_options=options) as session, session.begin():
        yield session


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded, jittered exponential backoff for units of work (run by tenacity)."""

    attempts: int = 5
    base_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ConfigError(f"attempts must be >= 1, got {self.attempts}")
        if self.base_delay_s < 0:
            raise ConfigError(f"base_delay_s must be >= 0, got {self.base_delay_s}")
        if self.max_delay_s < self.base_delay_s:
            raise ConfigError(
                f"max_delay_s must be >= base_delay_s, got {self.max_delay_s} < {self.base_delay_s}"
            )

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(max, base·2^attempt)], so retrying writers spread out."""
        return rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


DEFAULT_RETRY: Final = RetryPolicy()


def unit_of_work(
    factory: sessionmaker[Session],
    fn: Callable[[Session], T],
    *,
    write: bool = True,
    isolation_level: str | None = None,
    retry: RetryPolicy = DEFAULT_RETRY,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
    what: str = "unit of work",
) -> T:
    """Run ``fn(session)`` in one transaction, again from the start on a retryable failure.

    ``fn`` must be a pure function of the database (it may run several times;
    only the last run commits). Retried: a dropped connection, a PostgreSQL
    serialization failure or deadlock, SQLite busy, and a version-counter
    mismatch (the re-run reads the other writer's row). After
    ``retry.attempts`` runs it raises :class:`StoreUnavailable`, or
    :class:`StaleWrite` when versions kept moving. Everything else, including
    every other TideError (a fencing ``Conflict`` above all), propagates at
    once. ``what`` names the work in logs, e.g. "create decision for job ns/a".
    """
    rng = rng or random.Random()

    def log_retry(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        store_metrics.RETRIES.labels(failure_cause(exc)).inc()
        cause = type(exc.orig if isinstance(exc, DBAPIError) else exc).__name__
        delay = state.next_action.sleep if state.next_action is not None else 0.0
        logger.warning(
            "%s: attempt %d/%d failed (%s), retrying in %.3f s",
            what,
            state.attempt_number,
            retry.attempts,
            cause,
            delay,
        )

    retrying = Retrying(
        stop=stop_after_attempt(retry.attempts),
        # Full jitter from the policy, with the caller's random source.
        wait=lambda state: retry.delay_s(state.attempt_number - 1, rng),
        retry=retry_if_exception(_retryable_work_error),
        sleep=sleep,
        before_sleep=log_retry,
        reraise=False,
    )

    def once() -> T:
        # The GIL comes back to this thread quickly while it runs SQL (tide/services/common/gil.py).
        with (
            SWITCH.short(),
            session_scope(factory, write=write, isolation_level=isolation_level) as session,
        ):
            return fn(session)

    try:
        return retrying(once)
    except DBAPIError as unusable:
        if not is_store_unusable(unusable):
            raise
        store_metrics.FAILURES.labels(failure_cause(unusable)).inc()
        raise StoreUnavailable(f"{what}: database cannot be written: {unusable.orig}") from unusable
    except RetryError as gave_up:
        exc = gave_up.last_attempt.exception()
        store_metrics.FAILURES.labels(failure_cause(exc)).inc()
        if isinstance(exc, StaleWrite):
            raise exc from None
        if isinstance(exc, StaleDataError):
            raise StaleWrite(f"{what}: a concurrent writer changed the row first") from exc
        assert isinstance(exc, DBAPIError)
        raise StoreUnavailable(
            f"{what}: database unavailable after {retry.attempts} attempts: {exc.orig}"
        ) from exc


def _retryable_work_error(exc: BaseException) -> bool:
    """What :func:`unit_of_work` runs again: a lost version race, or a database error
    that left no effect (:func:`is_retryable`)."""
    if isinstance(exc, (StaleDataError, StaleWrite)):
        return True
    return isinstance(exc, DBAPIError) and is_retryable(exc)


# --- migrations -----------------------------------------------------------------------------

# Package-resource form, so that Alembic finds the scripts in an installed wheel too.
_SCRIPT_LOCATION: Final = "tide.services.store:migrations"


def alembic_config(connection: Connection | None = None) -> Any:
    """An Alembic Config pointing at our migrations; with ``connection``, env.py runs on it."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", _SCRIPT_LOCATION)
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


# Arbitrary constant naming the PostgreSQL advisory lock that serialises migrations.
_MIGRATION_LOCK_KEY: Final = 0x7469_6465  # "tide"


def _run_alembic(url: str, action: Callable[[Any], None], settings: DbSettings | None) -> None:
    engine = make_engine(url, settings)
    try:
        with engine.connect() as conn:
            sqlite = conn.dialect.name == "sqlite"
            raw = conn.connection.driver_connection
            if raw is None:
                raise RuntimeError("the pool handed out a closed connection")
            if sqlite:
                # Batch migrations copy and drop tables; with foreign keys on, the
                # drop would cascade or fail. The pragma is a no-op inside a
                # transaction, so it goes to the driver before any BEGIN.
                raw.execute("PRAGMA foreign_keys = OFF")
            # One transaction around all of it (env.py joins it): on SQLite BEGIN
            # IMMEDIATE and on PostgreSQL an advisory lock make two services that
            # start together migrate one after the other, the second finding head.
            conn.execution_options(**{_BEGIN_OPTION: "IMMEDIATE"})
            try:
                with conn.begin():
                    if not sqlite:
                        # Wait as long as the other migration takes, not lock_timeout.
                        conn.exec_driver_sql("SET LOCAL lock_timeout = 0")
                        # Between its statements the migration runs Python (alembic loads
                        # each revision's script): on a starved node that outlasted the
                        # session's idle-in-transaction bound and the server ended the
                        # upgrade. A migrator that dies still releases the lock with its
                        # connection.
                        conn.exec_driver_sql("SET LOCAL idle_in_transaction_session_timeout = 0")
                        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK_KEY})")
                    action(alembic_config(conn))
                    if sqlite:
                        bad = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                        if bad:
                            raise RuntimeError(f"migration left dangling foreign keys: {bad[:5]}")
            finally:
                if sqlite:
                    raw.execute("PRAGMA foreign_keys = ON")
    finally:
        engine.dispose()


def _migrate(
    url: str, what: str, action: Callable[[Any], None], settings: DbSettings | None
) -> None:
    from alembic.util import CommandError

    try:
        _run_alembic(url, action, settings)
    except CommandError as exc:
        # Alembic's word for an unknown revision or a broken history.
        raise InvalidArgument(f"{what} {redact_url(url)}: {exc}") from exc
    except DBAPIError as exc:
        raise Unavailable(f"{what} {redact_url(url)}: database unavailable: {exc.orig}") from exc


def upgrade(url: str, revision: str = "head", settings: DbSettings | None = None) -> None:
    """Bring the schema at ``url`` up to ``revision``; safe to call at every start."""
    from alembic import command

    logger.info("migrating database %s to %s", redact_url(url), revision)
    _migrate(url, "upgrade", lambda cfg: command.upgrade(cfg, revision), settings)


def downgrade(url: str, revision: str, settings: DbSettings | None = None) -> None:
    """Take the schema at ``url`` down to ``revision`` ("base" drops every table)."""
    from alembic import command

    logger.info("downgrading database %s to %s", redact_url(url), revision)
    _migrate(url, "downgrade", lambda cfg: command.downgrade(cfg, revision), settings)


def current_revision(url: str, settings: DbSettings | None = None) -> str | None:
    """The revision the database at ``url`` is at; None for an empty database."""
    from alembic.runtime.migration import MigrationContext

    engine = make_engine(url, settings)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except DBAPIError as exc:
        raise Unavailable(f"database {redact_url(url)} unavailable: {exc.orig}") from exc
    finally:
        engine.dispose()


def redact_url(url: str) -> str:
    """The URL for logs and messages, password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<unparseable url>"
