"""Decision history one page at a time: keyset pagination with opaque tokens."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

from sqlalchemy import ColumnElement, Row, and_, or_, select
from sqlalchemy.orm import Session

from services.scaler.store.records import DecisionPage, DecisionState
from services.scaler.store.rows import DECISIONS, aware, decision_record
from services.store.models.scaler import Decision
from tidebase.errors import InvalidArgument

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
    ``inputs`` unless ``with_inputs``) and the next page's token: what a reader that
    prints rows as they are (`tide history --db`) reads, converting each once; its
    pages go up to MAX_ROWS_PAGE_SIZE (the API's, :func:`list_decisions`, to 1,000)."""
    if not (1 <= page_size <= MAX_ROWS_PAGE_SIZE):
        raise InvalidArgument(f"page_size must be in 1..{MAX_ROWS_PAGE_SIZE}, got {page_size}")
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
    # Plain rows, not ORM objects: a page is read and dropped, and building 500
    # entities in the identity map cost more than the query (bench/history.py).
    table = DECISIONS
    columns = [c for c in table.c if with_inputs or c.name != "inputs"]
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
        token = _encode_token(_Cursor(last.created_at, last.id, fingerprint))
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
