"""A coordinator store that fails on command: the store faults of a resize (issue 30).

It wraps a real store (memory, SQLite or PostgreSQL) and fails as
:class:`tide.services.coordinator.sql_store.SqlStore` does once ``unit_of_work`` has spent
its retries: :class:`~tide.base.errors.StoreUnavailable`, with nothing written.
``fail_saves`` fails that many commits and then lets them through (a commit that fails
once); ``down`` fails every commit and every load until it is cleared (the store down
for longer than the retry budget).
"""

from __future__ import annotations

from tide.base.errors import StoreUnavailable
from tide.services.coordinator.store import CoordinatorStore, JobSnapshot, Unit


class FlakyStore:
    def __init__(self, inner: CoordinatorStore) -> None:
        self.inner = inner
        self.fail_saves = 0
        self.down = False
        self.failed = 0

    def _fail(self, what: str) -> None:
        self.failed += 1
        raise StoreUnavailable(f"{what}: database unavailable after 5 attempts (injected)")

    def save(self, unit: Unit) -> None:
        if self.down:
            self._fail("coordinator unit")
        if self.fail_saves > 0:
            self.fail_saves -= 1
            self._fail("coordinator unit")
        self.inner.save(unit)

    def load_all(self) -> list[JobSnapshot]:
        if self.down:
            self._fail("load coordinator state")
        return self.inner.load_all()
