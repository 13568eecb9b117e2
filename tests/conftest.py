"""Shared fixtures and the tier rule. Per-area fixtures live next to their tests;
support code that tests import lives in tests/support, never in a conftest."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
import sqlalchemy as sa

from tests.support import leaks, paddle_template
from tests.support.pg import admin_engine

if TYPE_CHECKING:
    # Imported where used: it brings gRPC and the protos, which most tests never need.
    from tide.services.testing.refcache import ReferenceRuns

# Services started by tests serve plaintext unless a test gives them TLS (tests/security and
# local mode do): a process without TLS and without --insecure exits 2 (docs/security.md).
os.environ.setdefault("TIDE_INSECURE", "1")

# Every process a test starts carries this session's mark, so what outlives its test
# is found and killed at the end (tests/support/leaks.py).
leaks.mark_session()


def pytest_configure(config: pytest.Config) -> None:
    # A process that runs tests forks its Paddle processes from one template; the xdist
    # controller runs none.
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        paddle_template.start()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    leaks.note_test(item.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    leaks.remember_status(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    # The template after the leak check: what it forked dies with it, unseen by the check.
    leaks.end_session(spare=paddle_template.pids())
    paddle_template.stop()


# Every test module names exactly one tier in its ``pytestmark`` (docs/architecture.md):
# unit (pure), component (in-process, fakes, a fake clock, sockets on loopback),
# integration (real processes, PostgreSQL, Paddle) and e2e (the whole stack).
TIERS = ("unit", "component", "integration", "e2e")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = sorted(
        {
            item.nodeid.split("::")[0]
            for item in items
            if sum(1 for t in TIERS if item.get_closest_marker(t)) != 1
        }
    )
    if wrong:
        raise pytest.UsageError(
            "each test module needs exactly one tier marker "
            f"({', '.join(TIERS)}) in its pytestmark: {', '.join(wrong)}"
        )


@pytest.fixture(scope="session")
def pg_admin(pg_url: str) -> Iterator[sa.Engine]:
    """An autocommit engine on the test database (tests/support/pg.py: skip or fail)."""
    engine = admin_engine(pg_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def pg_url() -> str:
    """URL of the PostgreSQL test database; `make test` sets TIDE_TEST_PG_URL."""
    url = os.environ.get(
        "TIDE_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/tide_test"
    )
    return url


@pytest.fixture(scope="session")
def reference_runs(tmp_path_factory: pytest.TempPathFactory) -> ReferenceRuns:
    """Fixed-size reference runs shared by this session's tests (tide/services/testing/refcache.py):
    each distinct run once, whichever xdist worker needs it first. Under xdist every worker's
    base temp is a directory of the controller's, so their parent is the session's own."""
    from tide.services.testing.refcache import ReferenceRuns

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    # TIDE_SHARED_REFERENCE_RUNS=0: each test runs its own, as before the cache (to compare).
    shared = os.environ.get("TIDE_SHARED_REFERENCE_RUNS", "1") != "0"
    return ReferenceRuns(base / "reference-runs", shared=shared)


def _cpu_s() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[object]:
    """With TIDE_TEST_CPU_LOG set, append each test's CPU seconds (this worker's own and
    its reaped processes', set-up and teardown included) and wall seconds to that file: on a
    shared, loaded machine wall time says little about what a test costs."""
    path = os.environ.get("TIDE_TEST_CPU_LOG")
    if not path:
        return (yield)
    (own0, kids0), wall0 = _cpu_s(), time.monotonic()
    try:
        return (yield)
    finally:
        (own1, kids1), wall = _cpu_s(), time.monotonic() - wall0
        with open(path, "a") as out:
            out.write(f"{item.nodeid}\t{own1 - own0:.2f}\t{kids1 - kids0:.2f}\t{wall:.2f}\n")


@pytest.fixture(autouse=True)
def _process_log_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no process-wide log ids: `tide.base.logs.bind_process` (the
    launcher's parse_args binds the job) would otherwise leak into the next test's lines
    (test_launch then test_logs failed in that order)."""
    from tide.base import logs

    monkeypatch.setattr(logs, "_process", {})
