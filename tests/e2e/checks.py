"""Assertions on the logs of the example scripts: exactly-once samples, parity."""

from tide.services.testing.parity import (
    check_exactly_once,
    final_losses,
    max_rel_loss_diff,
    max_rel_param_diff,
    samples_per_step,
    steps_by_generation,
)

__all__ = [
    "check_exactly_once",
    "final_losses",
    "max_rel_loss_diff",
    "max_rel_param_diff",
    "samples_per_step",
    "steps_by_generation",
]
