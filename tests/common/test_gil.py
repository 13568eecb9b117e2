"""SwitchInterval: short while any unit of work runs, in any thread; normal otherwise."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from tide.services.common.gil import SwitchInterval

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _restore() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_unconfigured_changes_nothing() -> None:
    sys.setswitchinterval(0.003)
    s = SwitchInterval()
    with s.short():
        assert sys.getswitchinterval() == pytest.approx(0.003)
        assert s.busy == 1
    assert sys.getswitchinterval() == pytest.approx(0.003)
    assert s.busy == 0


def test_short_while_any_unit_runs_in_any_thread() -> None:
    s = SwitchInterval()
    s.configure(0.0005, 0.005)
    assert sys.getswitchinterval() == pytest.approx(0.005)
    entered, release = threading.Event(), threading.Event()

    def other() -> None:
        with s.short():
            entered.set()
            release.wait(10)

    t = threading.Thread(target=other)
    with s.short():
        assert sys.getswitchinterval() == pytest.approx(0.0005)
        t.start()
        assert entered.wait(10)
    # The other thread's unit still runs: still short.
    assert s.busy == 1
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    release.set()
    t.join(10)
    assert s.busy == 0
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_an_error_in_the_unit_still_restores_the_normal_interval() -> None:
    s = SwitchInterval()
    s.configure(0.0005, 0.004)
    with pytest.raises(RuntimeError), s.short():
        raise RuntimeError("boom")
    assert s.busy == 0
    assert sys.getswitchinterval() == pytest.approx(0.004)


def test_configure_during_a_unit_takes_effect_at_once_and_names_a_bad_value() -> None:
    s = SwitchInterval()
    with s.short():
        s.configure(0.001, 0.006)
        assert sys.getswitchinterval() == pytest.approx(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.006)
    with pytest.raises(ValueError, match="short_s=0"):
        s.configure(0, 0.005)
    with pytest.raises(ValueError, match="normal_s=-1"):
        s.configure(0.001, -1)
