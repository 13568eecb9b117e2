"""`tide history`'s table rows made straight from the store's rows (``--db``) and from the
API's messages (``--scaler``) against the same rows made the slow way, from each
decision's record, on SQLite and on a PostgreSQL session in another time zone."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import sqlalchemy as sa

from tests.cli.seed import seed
from tests.support.pg import schema_url
from tide.services.cli import render
from tide.services.cli.output import PlainStream
from tide.services.scaler import store as repo
from tide.services.scaler.convert import decision_row_to_proto, decision_to_proto
from tide.services.store import db

pytestmark = pytest.mark.component


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgresql", id="pg", marks=pytest.mark.postgres),
    ]
)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'tide.db'}"
        return
    admin: sa.Engine = request.getfixturevalue("pg_admin")
    pg_url: str = request.getfixturevalue("pg_url")
    with schema_url(admin, pg_url, "cli_rows") as u:
        # A session whose TimeZone is not UTC: the table's times must still be UTC.
        yield u + quote(" -ctimezone=Asia/Kolkata")


def expected_row(r: repo.DecisionRecord, *, wide: bool) -> tuple[str, ...]:
    """The row as every `tide history` table showed it, from the record's values."""

    def short(t: datetime) -> str:
        return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S")

    row: tuple[str, ...] = (
        str(r.id),
        short(r.created_at),
        r.job_id,
        f"{r.from_replicas}→{r.to_replicas}",
        r.reason,
        r.state.value,
        f"{r.pause_s:.2f}s" if r.pause_s else "-",
        r.requested_by or r.trigger.lower(),
    )
    if wide:
        row += (r.trigger, str(r.generation), str(r.lost_steps), short(r.updated_at))
    return (*row, r.error or r.message)


def add_fractional(url: str) -> None:
    """Decisions made within one second, at times with microseconds (the keyset cursor
    must carry them exactly) and one at a whole second."""
    engine = db.make_engine(url)
    factory = db.make_session_factory(engine)
    base = datetime(2026, 12, 1, 9, 0, 59, 999_999, tzinfo=UTC)
    try:
        with db.session_scope(factory) as s:
            repo.upsert_job(s, "ml/frac", min_replicas=1, max_replicas=9, now=base)
            epoch = repo.acquire_job_ownership(s, "ml/frac", "t", now=base)
        for i, micros in enumerate((0, 1, 500_000, 999_999, 999_999)):
            at = base.replace(microsecond=micros) + timedelta(seconds=i // 4)
            with db.session_scope(factory) as s:
                d = repo.create_decision(
                    s,
                    job_id="ml/frac",
                    from_replicas=1,
                    to_replicas=2 + i,
                    reason="MANUAL",
                    trigger="MANUAL",
                    message=f"  two\nlines {i} ",
                    inputs={},
                    epoch=epoch,
                    now=at,
                    requested_by="" if i % 2 else "bob",
                )
                repo.transition_decision(
                    s, d.id, repo.DecisionState.ABORTED, detail="x", epoch=epoch, now=at
                )
    finally:
        engine.dispose()


def pages(read: Any, factory: Any, **kw: Any) -> list[Any]:
    out: list[Any] = []
    token = ""
    while True:
        with db.session_scope(factory, write=False) as s:
            rows, token = read(s, page_size=2, page_token=token, **kw)
        out.extend(rows)
        if not token:
            return out


@pytest.mark.parametrize("wide", [False, True], ids=["table", "wide"])
def test_table_rows_match_the_records(url: str, wide: bool) -> None:
    seed(url)
    add_fractional(url)
    engine = db.make_engine(url)
    factory = db.make_session_factory(engine)
    try:
        for job in ("", "ml/frac", "ml/resnet"):
            with db.session_scope(factory, write=False) as s:
                records = repo.list_decisions(s, job_id=job, page_size=1000).decisions
            assert records
            want = [expected_row(r, wide=wide) for r in records]
            table = pages(repo.history_table_rows, factory, job_id=job, wide=wide)
            assert render.history_rows_of_store(table, wide=wide) == want
            messages = [decision_to_proto(r) for r in records]
            assert render.history_rows(messages, wide=wide)[1] == want
            # The API's pages: each row to its message straight, as from its record.
            wide_rows = pages(repo.history_table_rows, factory, job_id=job, wide=True)
            assert [decision_row_to_proto(r) for r in wide_rows] == messages
        # The same keyset pages as the API's rows, filters and all.
        since = datetime(2026, 12, 1, 9, 0, 59, 999_999, tzinfo=UTC)
        kw: dict[str, Any] = {"job_id": "ml/frac", "since": since}
        plain = pages(repo.decision_rows, factory, with_inputs=False, **kw)
        table = pages(repo.history_table_rows, factory, **kw)
        assert [r.id for r in table] == [r.id for r in plain]
        assert len(table) == 2
    finally:
        engine.dispose()


def test_an_unset_time_is_a_dash() -> None:
    from tide.v1 import scaler_pb2

    d = scaler_pb2.Decision(id=7, job_id="j", message="m")
    row = render.history_rows([d], wide=True)[1][0]
    assert row[1] == "-"
    assert row[-2] == "-"


def test_plain_stream_pads_as_ljust_and_folds_free_text(capsys: pytest.CaptureFixture[str]) -> None:
    stream = PlainStream(("A", "BB", "MESSAGE"), no_headers=False, free_text=(-1,))
    stream.write([("1", "x", "  a\n b "), ("22", "yyy", "")])
    stream.write([("333333", "z", "c")])  # wider than the first batch: pushes right
    assert capsys.readouterr().out == (
        "A    BB    MESSAGE\n1    x     a b\n22   yyy   -\n333333   z     c\n"
    )
