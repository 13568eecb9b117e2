"""The whole loop through the Kubernetes actuator (tide/services/testing/kube/loop.py): the
scaler and coordinator as processes, a PaddleJob on the API server emulator whose
pods the stand-in kubelet runs as real launchers with Paddle workers, load that
drives a grow and a shrink, a 409 and a 410 injected on the way."""

from __future__ import annotations

from pathlib import Path

import pytest

from tide.services.testing.kube.loop import KubeLoop, LoopSettings

pytestmark = [pytest.mark.e2e, pytest.mark.paddle, pytest.mark.slow]


@pytest.mark.timeout(400)
async def test_grow_and_shrink_a_paddlejob_losing_nothing(tmp_path: Path) -> None:
    out = await KubeLoop(LoopSettings(tmp_path / "loop")).run()
    assert not out.error, out.error
    grows, shrinks = out.completed(grow=True), out.completed(grow=False)
    assert len(grows) == 1 and len(shrinks) == 1, out.decisions
    assert (grows[0].from_replicas, grows[0].to_replicas) == (2, 4)
    assert (shrinks[0].from_replicas, shrinks[0].to_replicas) == (4, 2)
    # Nothing lost, every sample once, across the three generations.
    assert out.lost_steps == 0
    assert out.audit is not None and out.audit.exactly_once, out.audit and out.audit.summary()
    assert [w for _, w in out.audit.worlds] == [2, 4, 2]
    # The PaddleJob asks for what the coordinator runs.
    assert out.paddlejob_replicas == out.world_size == 2
    # The members that stayed are the pods the operator kept: the shrink drained the
    # highest indexes, the ones it deleted.
    assert out.member_pods == out.job_pods == ["mlp-worker-0", "mlp-worker-1"]
    # The story is on the PaddleJob, HPA-style.
    reasons = [r for _, r, _ in out.events]
    assert reasons.count("SuccessfulRescale") == 3  # the start, the grow, the shrink
    assert "Adopted" in reasons and not [e for e in out.events if e[0] == "Warning"]
    assert any("New size: 4" in m for _, r, m in out.events if r == "SuccessfulRescale")
    # The injected 409 was re-read and retried; the cut watches re-listed after a 410.
    # Any other 409 was a real race (another writer between the scaler's read and its write,
    # seen under load) and was retried the same way: the resizes completed.
    assert out.injected_conflicts == 1
    assert out.expired_watches >= 1
