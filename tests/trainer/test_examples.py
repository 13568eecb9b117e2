"""The transformer example as fixed-size runs: with virtual ranks its dropout masks, and so
its trajectory, do not depend on the world size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tide.services.testing.localjob import ROOT, reference_run
from tide.services.testing.parity import final_losses, max_rel_loss_diff

pytestmark = [pytest.mark.integration, pytest.mark.paddle, pytest.mark.slow]

TRANSFORMER = str(ROOT / "tide" / "trainer" / "examples" / "train_transformer.py")


def test_transformer_with_dropout_and_virtual_ranks_does_not_depend_on_the_world(
    tmp_path: Path,
) -> None:
    args = [
        "--steps", "6",
        "--dataset-size", "64",
        "--global-batch", "16",
        "--d-model", "16",
        "--layers", "1",
        "--dropout", "0.2",
        "--virtual-ranks", "2",
        "--accumulation-steps", "2",
    ]  # fmt: skip
    one = reference_run(tmp_path / "w1", args, world_size=1, example=TRANSFORMER)
    two = reference_run(tmp_path / "w2", args, world_size=2, example=TRANSFORMER)
    assert len(final_losses(one)) == 6
    assert max_rel_loss_diff(final_losses(two), final_losses(one)) < 1e-5
    # Every parameter but the attention keys' bias: softmax ignores a shift of all keys, so
    # its gradient is zero up to rounding, and AdamW turns that rounding into full-size steps.
    a, b = np.load(two / "final_params.npz"), np.load(one / "final_params.npz")
    for key in a.files:
        if not key.endswith("k_proj.bias"):
            scale = max(float(np.max(np.abs(b[key]))), 1e-12)
            assert float(np.max(np.abs(a[key] - b[key]))) / scale < 1e-5, key
