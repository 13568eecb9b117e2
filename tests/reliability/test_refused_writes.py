"""Issue 30: a write the store refused is not logged as done ("autoscaling paused=True")."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tide.base.errors import StoreUnavailable
from tide.services.scaler.store.decision_store import DecisionStore
from tide.services.store import db
from tide.services.testing.clock import FakeClock

pytestmark = pytest.mark.component


async def test_a_refused_pause_is_not_logged_as_paused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'tide.db'}"
    db.upgrade(url)
    store = DecisionStore(db.make_engine(url), "refused", FakeClock())
    try:
        await store.upsert_job("ns/a", initial_replicas=2, min_replicas=1, max_replicas=4)

        def refused(factory: Any, fn: Any, **kw: Any) -> Any:
            # The unit runs (and would log inside it), then its commit is refused.
            with db.session_scope(factory) as s:
                fn(s)
                s.rollback()
            raise StoreUnavailable("set paused: database cannot be written (injected)")

        monkeypatch.setattr(db, "unit_of_work", refused)
        caplog.set_level(logging.INFO)
        with pytest.raises(StoreUnavailable):
            await store.set_paused("ns/a", True, "maintenance")
        assert "paused=True" not in caplog.text
        monkeypatch.undo()
        await store.set_paused("ns/a", True, "maintenance")
        assert "autoscaling paused=True (maintenance)" in caplog.text
    finally:
        store.close()
