"""HeapFreezer: the heap is frozen as the fleet grows by a quarter, not on every pass."""

from __future__ import annotations

import pytest

from tide.services.common import heap
from tide.services.common.heap import HeapFreezer

pytestmark = pytest.mark.unit


def test_freezes_once_per_quarter_of_growth(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    # The real gc.freeze would move pytest's own heap into the permanent generation.
    monkeypatch.setattr(heap.gc, "collect", lambda gen: calls.append(f"collect {gen}") or 0)
    monkeypatch.setattr(heap.gc, "freeze", lambda: calls.append("freeze"))
    f = HeapFreezer(growth_fraction=0.25, min_growth=64)
    assert not f.grown(63)  # below the minimum growth
    assert f.grown(64)
    assert calls == ["collect 1", "freeze"]  # the young garbage is collected first
    assert not f.grown(127)
    assert f.grown(128)
    assert f.grown(1000)
    assert not f.grown(1249)  # a quarter of 1,000 is more than the minimum
    assert f.grown(1250)
    assert not f.grown(100)  # a fleet that shrank is not frozen again
    assert (f.freezes, f.frozen_at) == (4, 1250)
    assert calls == ["collect 1", "freeze"] * 4


def test_tune_collector_sets_the_thresholds_and_returns_the_old_ones() -> None:
    before = heap.gc.get_threshold()
    try:
        assert heap.tune_collector((1234, 5, 678)) == before
        assert heap.gc.get_threshold() == (1234, 5, 678)
        assert heap.tune_collector() == (1234, 5, 678)
        assert heap.gc.get_threshold() == heap.GC_THRESHOLDS
    finally:
        heap.gc.set_threshold(*before)
