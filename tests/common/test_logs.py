"""The logging convention (tide.base.logs): ids bound to a scope become fields of every line."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from tide.base import logs

pytestmark = pytest.mark.unit

RFC3339_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    out = io.StringIO()
    logs.configure("INFO", "json", stream=out)
    try:
        yield out
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
        logs._process.clear()


def lines(out: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_bound_ids_are_fields_of_every_line_in_the_block(captured: io.StringIO) -> None:
    log = logging.getLogger("t")
    with logs.bound(job_id="ns/a"):
        log.info("outer")
        with logs.bound(decision_id=7):
            log.info("inner")
        log.info("after inner")
    log.info("outside")
    got = [(d["msg"], d.get("job_id"), d.get("decision_id")) for d in lines(captured)]
    assert got == [
        ("outer", "ns/a", None),
        ("inner", "ns/a", 7),
        ("after inner", "ns/a", None),
        ("outside", None, None),
    ]


def test_json_line_has_rfc3339_time_level_logger_and_message(captured: io.StringIO) -> None:
    logging.getLogger("services.x").warning("hello %s", "there")
    (doc,) = lines(captured)
    assert RFC3339_MS.match(str(doc["time"])), doc["time"]
    assert (doc["level"], doc["logger"], doc["msg"]) == ("WARNING", "services.x", "hello there")


def test_extra_wins_over_a_bound_id(captured: io.StringIO) -> None:
    with logs.bound(job_id="ns/a"):
        logging.getLogger("t").info("x", extra={"job_id": "ns/b"})
    assert lines(captured)[0]["job_id"] == "ns/b"


async def test_tasks_inherit_the_binding_and_never_see_each_others(
    captured: io.StringIO,
) -> None:
    log = logging.getLogger("t")

    async def work(job: str) -> None:
        logs.bind(job_id=job)
        await asyncio.sleep(0)
        log.info("working on %s", job)
        await asyncio.to_thread(log.info, "in a thread for %s", job)

    with logs.bound(node="n1"):
        await asyncio.gather(work("ns/a"), work("ns/b"))
    for doc in lines(captured):
        assert str(doc["msg"]).endswith(str(doc["job_id"])), doc
        assert doc["node"] == "n1"


def test_process_ids_are_under_the_bound_ones(captured: io.StringIO) -> None:
    logs.bind_process(job_id="ns/a", member="m-1")
    with logs.bound(member="m-2"):
        logging.getLogger("t").info("x")
    doc = lines(captured)[0]
    assert (doc["job_id"], doc["member"]) == ("ns/a", "m-2")


def test_an_unknown_key_is_refused_not_dropped() -> None:
    with pytest.raises(TypeError, match="member_id"), logs.bound(member_id="m"):
        pass


def test_text_lines_put_the_ids_last_as_key_value() -> None:
    out = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:]
    logs.configure("INFO", "text", stream=out)
    try:
        with logs.bound(job_id="ns/a", decision_id=3):
            logging.getLogger("t").info("moved")
    finally:
        root.handlers[:] = saved
    line = out.getvalue().strip()
    assert RFC3339_MS.match(line.split(" ")[0])
    assert line.endswith("INFO t: moved job_id=ns/a decision_id=3")


def test_alembic_start_up_lines_stay_below_info(captured: io.StringIO) -> None:
    logging.getLogger("alembic.runtime.migration").info("Context impl SQLiteImpl.")
    logging.getLogger("alembic.runtime.migration").warning("a real problem")
    assert [d["msg"] for d in lines(captured)] == ["a real problem"]


def test_a_bad_format_is_refused() -> None:
    with pytest.raises(ValueError, match="'xml'"):
        logs.configure("INFO", "xml")
