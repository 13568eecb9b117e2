"""Decision history one page at a time: keyset pagination with opaque tokens."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final

from sqlalchemy import ColumnElement, DateTime, Row, and_, or_, select
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.orm import Session
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.functions import FunctionElement

from tide.base.errors import InvalidArgument
from tide.services.scaler.store.records import DecisionPage, DecisionState
from tide.services.scaler.store.rows import DECISIONS, aware, decision_record
from tide.services.store.models.scaler import Decision

MAX_PAGE_SIZE: Final = 1000
#: :func:`decision_rows`' most for a reader of the store itself (`tide history --db`),
#: where no message has to fit an RPC.
MAX_ROWS_PAGE_SIZE: Final = 10_000
DEFAULT_PAGE_SIZE: Final = 100


@dataclass(frozen=True)
class _Cursor:
    created_at: datetime
    id: int
    # Fingerprint of the filters the token was issued for.
    filters: str


def list_decisions(
    session: Session,
    *,
    job_id: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    states: Sequence[DecisionState] = (),
    page_size: int = DEFAULT_PAGE_SIZE,
    page_token: str = "",
    with_inputs: bool = True,
) -> DecisionPage:
    """Decisions newest first, filtered, one page at a time (keyset on (created_at, id)).

    ``since`` is inclusive and ``until`` exclusive. A token only works with
    the filters it was issued for. Rows inserted while paging show up on a
    later call if they are older than the cursor, never twice.

    ``with_inputs=False`` leaves each record's ``inputs`` empty and does not read
    them: the API's Decision carries no inputs (GetDecision does), and parsing
    20,000 JSON documents was a fifth of a busy job's `tide history --all`.
    """
    if not (1 <= page_size <= MAX_PAGE_SIZE):
        raise InvalidArgument(f"page_size must be in 1..{MAX_PAGE_SIZE}, got {page_size}")
    rows, token = decision_rows(
        session,
        job_id=job_id,
        since=since,
        until=until,
        states=states,
        page_size=page_size,
        page_token=page_token,
        with_inputs=with_inputs,
    )
    records = tuple(decision_record(r, with_inputs=with_inputs) for r in rows)
    return DecisionPage(decisions=records, next_page_token=token)


def decision_rows(
    session: Session,
    *,
    job_id: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    states: Sequence[DecisionState] = (),
    page_size: int = DEFAULT_PAGE_SIZE,
    page_token: str = "",
    with_inputs: bool = True,
) -> tuple[list[Row[Any]], str]:
    """:func:`list_decisions`' page as plain rows (the decisions table's columns, less
    ``inputs`` unless ``with_inputs``) and the next page's token, for a reader that
    converts each row once (the API's pages, `tide history --db`'s documents); its
    pages go up to MAX_ROWS_PAGE_SIZE (the API's, :func:`list_decisions`, to 1,000)."""
    if not (1 <= page_size <= MAX_ROWS_PAGE_SIZE):
        raise InvalidArgument(f"page_size must be in 1..{MAX_ROWS_PAGE_SIZE}, got {page_size}")
    # Plain rows, not ORM objects: a page is read and dropped, and building 500
    # entities in the identity map cost more than the query (bench/history.py).
    columns = [c for c in DECISIONS.c if with_inputs or c.name != "inputs"]
    return _page(
        session,
        columns,
        job_id,
        since,
        until,
        states,
        page_size,
        page_token,
        lambda r: r.created_at,
    )


class _UtcNaive(FunctionElement[datetime]):
    """A UTC time column read as a naive datetime of its UTC wall time: on PostgreSQL
    ``col AT TIME ZONE 'UTC'`` (a plain timestamp, which psycopg loads with no zone to
    convert from); SQLite stores that very value as text. The table reader's times,
    without the store's UTCDateTime conversion per value (a third of the read's CPU
    for 100,000 rows, docs/cli.md)."""

    type = DateTime()
    name = "utc_naive"
    inherit_cache = True


@compiles(_UtcNaive)
def _utc_naive_stored(element: _UtcNaive, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.clauses, **kw)


@compiles(_UtcNaive, "postgresql")
def _utc_naive_pg(element: _UtcNaive, compiler: SQLCompiler, **kw: Any) -> str:
    return f"({compiler.process(element.clauses, **kw)} AT TIME ZONE 'UTC')"


def history_table_rows(
    session: Session,
    *,
    job_id: str = "",
    since: datetime | None = None,
    until: datetime | None = None,
    states: Sequence[DecisionState] = (),
    page_size: int = DEFAULT_PAGE_SIZE,
    page_token: str = "",
    wide: bool = False,
) -> tuple[list[Row[Any]], str]:
    """:func:`decision_rows`' page (the same filters, order and tokens) as the columns
    of `tide history`'s table, in its order: id, created_at, job_id, from_replicas,
    to_replicas, reason, state, pause_s, requested_by, trigger, (``wide``: generation,
    lost_steps, updated_at,) error, message; the times naive, in UTC. What the table
    is drawn from with each row converted once (tide/services/cli/render.py)."""
    if not (1 <= page_size <= MAX_ROWS_PAGE_SIZE):
        raise InvalidArgument(f"page_size must be in 1..{MAX_ROWS_PAGE_SIZE}, got {page_size}")
    c = DECISIONS.c
    columns: list[Any] = [
        c.id,
        _UtcNaive(c.created_at).label("created_at"),
        c.job_id,
        c.from_replicas,
        c.to_replicas,
        c.reason,
        c.state,
        c.pause_s,
        c.requested_by,
        c.trigger,
    ]
    if wide:
        columns += [
            c.generation,
            c.lost_steps,
            _UtcNaive(c.updated_at).label("updated_at"),
        ]
    columns += [c.error, c.message]
    return _page(
        session,
        columns,
        job_id,
        since,
        until,
        states,
        page_size,
        page_token,
        lambda r: r.created_at.replace(tzinfo=UTC),
    )


def _page(
    session: Session,
    columns: Sequence[Any],
    job_id: str,
    since: datetime | None,
    until: datetime | None,
    states: Sequence[DecisionState],
    page_size: int,
    page_token: str,
    created_at: Any,
) -> tuple[list[Row[Any]], str]:
    """One keyset page of ``columns`` and the next page's token; ``created_at`` gives
    a row's aware creation time (the cursor)."""
    state_values = sorted({DecisionState(s).value for s in states})
    fingerprint = _fingerprint(job_id, since, until, state_values)
    conditions: list[ColumnElement[bool]] = []
    if job_id:
        conditions.append(Decision.job_id == job_id)
    if since is not None:
        conditions.append(Decision.created_at >= aware("since", since))
    if until is not None:
        conditions.append(Decision.created_at < aware("until", until))
    if state_values:
        conditions.append(Decision.state.in_(state_values))
    if page_token:
        cursor = _decode_token(page_token)
        if cursor.filters != fingerprint:
            raise InvalidArgument("page_token was issued for different filters")
        # The plain bound lets both engines start the index range scan at the
        # cursor; the OR alone would be a filter over every newer row.
        conditions.append(Decision.created_at <= cursor.created_at)
        conditions.append(
            or_(
                Decision.created_at < cursor.created_at,
                and_(Decision.created_at == cursor.created_at, Decision.id < cursor.id),
            )
        )
    rows = list(
        session.execute(
            select(*columns)
            .where(*conditions)
            .order_by(Decision.created_at.desc(), Decision.id.desc())
            .limit(page_size + 1)
        )
    )
    more = len(rows) > page_size
    rows = rows[:page_size]
    token = ""
    if more:
        last = rows[-1]
        token = _encode_token(_Cursor(created_at(last), last.id, fingerprint))
    return rows, token


def _fingerprint(
    job_id: str, since: datetime | None, until: datetime | None, states: list[str]
) -> str:
    key = json.dumps(
        [
            job_id,
            None if since is None else since.timestamp(),
            None if until is None else until.timestamp(),
            states,
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _encode_token(cursor: _Cursor) -> str:
    payload = json.dumps(
        {"t": cursor.created_at.isoformat(), "i": cursor.id, "f": cursor.filters},
        separators=(",", ":"),
    )
    return base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")


def _decode_token(token: str) -> _Cursor:
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        created_at = datetime.fromisoformat(data["t"])
        decision_id = int(data["i"])
        filters = str(data["f"])
    except (binascii.Error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"page_token {token[:40]!r} is not valid") from exc
    if created_at.tzinfo is None:
        raise InvalidArgument(f"page_token {token[:40]!r} is not valid")
    return _Cursor(created_at, decision_id, filters)
