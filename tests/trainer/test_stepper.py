"""The step contract in one process: mean losses weighted, accumulation, AMP's protocol,
virtual ranks' state, and what a checkpoint carries (tide/trainer/stepper.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tide.trainer.channel import NullChannel
from tide.trainer.session import DistEnv, ElasticSession, SessionConfig

pytestmark = [pytest.mark.integration, pytest.mark.paddle]


def _session(tmp_path: Path, steps: int, **kw: Any) -> ElasticSession:
    config = SessionConfig(
        dataset_size=60,
        global_batch=16,
        seed=2,
        max_steps=steps,
        checkpoint_dir=str(tmp_path / "ckpt"),
        **kw,
    )
    return ElasticSession(config, DistEnv(), NullChannel())


def _bn_run(session: ElasticSession, scaler: Any = None) -> tuple[list[float], Any]:
    import paddle

    from tide.trainer.examples.train_bn import SyntheticImages, build_model

    ds = SyntheticImages(60, 2)
    paddle.seed(2)
    model = build_model(4)
    opt = paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())
    session.attach(model, opt, scaler=scaler)
    session.init_process_group()
    session.restore()
    losses = []
    for mb in session.plans():
        x = paddle.to_tensor(ds.x[mb.local_indices])
        loss = paddle.nn.functional.cross_entropy(
            model(x), paddle.to_tensor(ds.y[mb.local_indices])
        )
        out = session.step(loss)
        if out is not None:
            losses.append(out)
    session.finish()
    return losses, model


def test_accumulated_micro_batches_give_the_whole_batch_step(tmp_path: Path) -> None:
    # The MLP has no BatchNorm: chunks of the batch sum to the batch's gradient.
    import paddle

    from tide.trainer.examples.train_mlp import build_model, make_dataset

    def run(acc: int) -> list[float]:
        s = _session(tmp_path / str(acc), 6, accumulation_steps=acc)
        x, y = make_dataset(60, 2)
        paddle.seed(2)
        model = build_model(8)
        s.attach(model, paddle.optimizer.Adam(learning_rate=0.01, parameters=model.parameters()))
        s.init_process_group()
        s.restore()
        out = []
        for mb in s.plans():
            logits = model(paddle.to_tensor(x[mb.local_indices]))
            loss = paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y[mb.local_indices]))
            if (g := s.step(loss)) is not None:
                out.append(g)
        return out

    one, three = run(1), run(3)
    assert len(one) == len(three) == 6
    np.testing.assert_allclose(three, one, rtol=1e-5)


def test_virtual_ranks_keep_one_batchnorm_state_each_and_checkpoint_them(
    tmp_path: Path,
) -> None:
    import paddle

    s = _session(tmp_path / "v", 4, virtual_ranks=2)
    _, model = _bn_run(s)
    virtual = s.stepper.virtual
    assert virtual is not None and virtual.shape[0] == 2
    assert not np.allclose(virtual[0], virtual[1]), "both virtual ranks saw the same batches"
    # After finish the model holds virtual rank 0's statistics, as the checkpoint does.
    means = [p.numpy() for p in model.parameters() if p.stop_gradient]
    assert np.allclose(np.concatenate([m.ravel() for m in means]), virtual[0])
    loaded = s.store.load_latest()
    assert "virtual.npy" in loaded.files
    # A restored run continues with both virtual ranks' state.
    s2 = _session(tmp_path / "v", 6, virtual_ranks=2)
    _bn_run(s2)
    assert s2.restored_step == 4
    straight = _session(tmp_path / "straight", 6, virtual_ranks=2)
    _bn_run(straight)
    assert np.allclose(s2.stepper.virtual, straight.stepper.virtual, rtol=1e-6)  # type: ignore[arg-type]
    del paddle


class FakeScaler:
    """GradScaler's protocol on a CPU (where Paddle disables the real one)."""

    def __init__(self) -> None:
        import paddle

        self.calls: list[str] = []
        self.scale_value = 4.0
        self._found_inf = paddle.to_tensor(False)
        self.loaded: dict[str, Any] = {}

    def is_enable(self) -> bool:
        return True

    def scale(self, loss: Any) -> Any:
        self.calls.append("scale")
        return loss * self.scale_value

    def unscale_(self, optimizer: Any) -> None:
        self.calls.append("unscale_")
        for p in optimizer._parameter_list:
            if p.grad is not None:
                p.grad.set_value(p.grad / self.scale_value)

    def step(self, optimizer: Any) -> None:
        self.calls.append("step")
        optimizer.step()

    def update(self) -> None:
        self.calls.append("update")

    def state_dict(self) -> dict[str, Any]:
        return {"scale": np.array([self.scale_value], dtype=np.float32), "incr_count": 3}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = dict(state)


def test_amp_scales_then_sums_then_unscales_and_checkpoints_the_scaler(
    tmp_path: Path,
) -> None:
    plain, _ = _bn_run(_session(tmp_path / "plain", 3))
    scaler = FakeScaler()
    scaled, _ = _bn_run(_session(tmp_path / "amp", 3), scaler=scaler)
    assert scaler.calls[:4] == ["scale", "unscale_", "step", "update"]
    np.testing.assert_allclose(scaled, plain, rtol=1e-5)
    again = FakeScaler()
    s = _session(tmp_path / "amp", 5)
    _bn_run(s, scaler=again)
    assert s.restored_step == 3 and again.loaded["incr_count"] == 3


def test_numpy_and_python_rngs_are_restored(tmp_path: Path) -> None:
    import random

    s = _session(tmp_path / "r", 2)
    _bn_run(s)
    expected = (np.random.random(), random.random())
    s2 = _session(tmp_path / "r", 2)
    np.random.seed(99)
    random.seed(99)
    _bn_run(s2)  # restores step 2's RNG states and trains nothing
    assert (np.random.random(), random.random()) == expected


def test_checkpoints_in_object_storage_restore_the_same_run(tmp_path: Path) -> None:
    url = f"memory://tide-stepper/{tmp_path.name}"
    first, _ = _bn_run(_session_at(url, 3))
    rest_session = _session_at(url, 6)
    rest, _ = _bn_run(rest_session)
    straight, _ = _bn_run(_session(tmp_path / "straight", 6))
    assert rest_session.restored_step == 3
    np.testing.assert_allclose(first + rest, straight, rtol=1e-5)


def _session_at(url: str, steps: int) -> ElasticSession:
    config = SessionConfig(
        dataset_size=60, global_batch=16, seed=2, max_steps=steps, checkpoint_dir=url
    )
    return ElasticSession(config, DistEnv(), NullChannel())
