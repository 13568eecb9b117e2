"""The HPA's rules as the simulator runs them, case by case against what the Kubernetes
documentation and pkg/controller/podautoscaler say (tolerance, stabilization, rate)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tide.services.sim.hpa import HpaState, normalize, recommend
from tide.services.sim.scenario import Hpa

pytestmark = pytest.mark.unit

H = Hpa()  # target 60 %, tolerance 0.1, down window 300 s, +max(4, 100 %) / 15 s


@pytest.mark.parametrize(
    ("cur", "metric", "want"),
    [
        (4, 60.0, 4),  # on target
        (4, 65.0, 4),  # within the 0.1 tolerance: ratio 1.08
        (4, 54.5, 4),  # ratio 0.908: within
        (4, 67.0, 5),  # ratio 1.117: ceil(4 x 1.117) = 5
        (4, 95.0, 7),  # ceil(6.33)
        (10, 30.0, 5),
        (4, 0.0, 0),
    ],
)
def test_the_replica_calculator(cur: int, metric: float, want: int) -> None:
    assert recommend(cur, metric, H) == want


@dataclass
class Case:
    name: str
    cur: int
    desired: int
    expect: int
    recs: list[tuple[float, int]] = field(default_factory=list)
    ups: list[tuple[float, int]] = field(default_factory=list)
    downs: list[tuple[float, int]] = field(default_factory=list)
    lo: int = 1
    hi: int = 100


NOW = 10_000.0
CASES = [
    Case("up: doubling allowed", 4, 8, 8),
    Case("up: +4 beats +100 % for small sizes", 2, 20, 6),
    Case("up: +100 % beats +4 for large sizes", 10, 40, 20),
    Case("up: what was added this period counts", 8, 20, 8, ups=[(NOW - 10, 4)]),
    Case("up: an older scale-up does not", 8, 20, 16, ups=[(NOW - 20, 4)]),
    Case("up: no stabilization window", 4, 8, 8, recs=[(NOW - 5, 4)]),
    Case("up: bounded by max", 4, 8, 6, hi=6),
    Case("down: the highest recommendation of 300 s wins", 8, 2, 6, recs=[(NOW - 200, 6)]),
    Case("down: older recommendations expire", 8, 2, 2, recs=[(NOW - 301, 6)]),
    Case("down: 100 % per period, bounded by min", 8, 0, 3, lo=3),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_stabilization_and_rate_limits(case: Case) -> None:
    st = HpaState(recs=list(case.recs), ups=list(case.ups), downs=list(case.downs))
    assert normalize(st, case.cur, case.desired, NOW, H, case.lo, case.hi) == case.expect
    assert st.recs[-1] == (NOW, case.desired)  # the raw recommendation is remembered
