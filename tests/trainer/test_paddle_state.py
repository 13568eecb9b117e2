"""The training state's two forms: Paddle's files (durable checkpoints) and the handover's
raw tensors; both must put back exactly the same state."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from tide.trainer import paddle_state, rawstate

paddle = pytest.importorskip("paddle")

pytestmark = [pytest.mark.integration, pytest.mark.paddle]


def _trained(seed: int = 3) -> tuple[Any, Any, Any]:
    paddle.seed(seed)
    model = paddle.nn.Sequential(paddle.nn.Linear(6, 8), paddle.nn.Tanh(), paddle.nn.Linear(8, 3))
    lr = paddle.optimizer.lr.StepDecay(learning_rate=0.05, step_size=2, gamma=0.5)
    opt = paddle.optimizer.Adam(learning_rate=lr, parameters=model.parameters())
    return model, opt, lr


def _step(model: Any, opt: Any, lr: Any, i: int) -> None:
    x = paddle.to_tensor(np.random.default_rng(i).standard_normal((4, 6)).astype(np.float32))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.clear_grad()
    lr.step()


def _state(model: Any, opt: Any) -> dict[str, np.ndarray]:
    out = {f"m:{k}": v.numpy() for k, v in model.state_dict().items()}
    positional = paddle_state.positional(model, opt.state_dict(), to_positions=True)
    out.update({f"o:{k}": v.numpy() for k, v in positional.items() if hasattr(v, "numpy")})
    return out


@pytest.mark.parametrize("form", ["raw", "paddle", "raw converted"])
def test_every_form_puts_back_the_same_trajectory(form: str) -> None:
    model, opt, lr = _trained()
    for i in range(3):
        _step(model, opt, lr, i)
    random.seed(7)
    np.random.seed(7)
    files = paddle_state.state_files(model, opt, lr, raw=form != "paddle")
    if form == "raw":
        assert files.arrays and paddle_state.MODEL not in files  # type: ignore[attr-defined]
        # As a durable store reads it back: state.tensors, bytes.
        files = {**files, rawstate.TENSORS: rawstate.encode(files.arrays)}  # type: ignore[attr-defined]
    if form == "raw converted":
        files = paddle_state.checkpoint_files(files)
        assert paddle_state.TENSORS not in files and paddle_state.RNG_RAW not in files
    expected_draws = (random.random(), np.random.random())

    other, other_opt, other_lr = _trained(seed=99)
    _step(other, other_opt, other_lr, 50)  # accumulators exist already: they are overwritten
    random.seed(1)
    np.random.seed(1)
    paddle_state.load_state(files, other, other_opt, other_lr)
    assert (random.random(), np.random.random()) == expected_draws
    assert other_lr.last_lr == lr.last_lr

    _step(model, opt, lr, 10)
    _step(other, other_opt, other_lr, 10)
    mine, theirs = _state(model, opt), _state(other, other_opt)
    assert mine.keys() == theirs.keys()
    for key in mine:
        np.testing.assert_array_equal(mine[key], theirs[key], err_msg=key)


def test_raw_tensors_round_trip_any_shape_and_dtype() -> None:
    arrays = {
        "a": np.arange(7, dtype=np.float32),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.int64),
        "m": np.arange(12, dtype=np.int32).reshape(3, 4),
    }
    back = rawstate.decode(rawstate.encode(arrays))
    assert back.keys() == arrays.keys()
    for key, value in arrays.items():
        assert back[key].dtype == value.dtype and back[key].shape == value.shape
        np.testing.assert_array_equal(back[key], value)
