"""bench/stage2_probe.py: the premise of stage 2's refusal (tide/trainer/sharding.py WHY_STAGE2),
checked against the Paddle installed: no way of asking for sharding stage 2 trains on the CPU.
When a Paddle release does, this fails, and stage 2's resharding can be built and tested here
(docs/sharded.md "Stage 2")."""

from __future__ import annotations

import pytest

pytest.importorskip("paddle")

pytestmark = [pytest.mark.component, pytest.mark.paddle]


def test_sharding_stage_2_does_not_train_on_the_cpu() -> None:
    from bench.stage2_probe import WAYS, probe

    found = probe(timeout_s=120.0)
    assert set(found) == set(WAYS)
    assert "trained" not in found.values(), found
    assert "hung" not in found.values(), found
    # The documented entry and the classes refuse the CPU themselves: the reasons the docs give.
    assert "only support gpu, xpu" in found["api"], found
    assert "Only GPU and XPU" in found["direct"], found
