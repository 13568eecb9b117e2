"""The session's contract in one process (tide/trainer/contract.py, tide/trainer/dataloader.py): the
calls' order, the loss's reduction, the batch delivered against the plan, and the data
path's random streams."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tide.services.testing.localjob import read_jsonl
from tide.trainer.channel import NullChannel
from tide.trainer.contract import (
    FORGOTTEN_SAMPLER,
    BatchMismatch,
    Deliveries,
    LossContractError,
    UsageError,
)
from tide.trainer.session import DistEnv, ElasticSession, SessionConfig

pytestmark = [pytest.mark.integration, pytest.mark.paddle]

DATASET, BATCH = 40, 8


def _session(tmp_path: Path, steps: int = 3, env: DistEnv | None = None, **kw: Any) -> Any:
    config = SessionConfig(
        dataset_size=DATASET,
        global_batch=BATCH,
        seed=5,
        max_steps=steps,
        checkpoint_dir=str(tmp_path / "ckpt"),
        log_dir=str(tmp_path / "logs"),
        **kw,
    )
    return ElasticSession(config, env or DistEnv(), NullChannel())


def _model() -> tuple[Any, Any]:
    import paddle

    from tide.trainer.examples.train_bn import build_model

    paddle.seed(1)
    model = build_model(4)
    return model, paddle.optimizer.SGD(learning_rate=0.1, parameters=model.parameters())


def _ready(tmp_path: Path, steps: int = 3, **kw: Any) -> tuple[Any, Any, Any]:
    from tide.trainer.examples.train_bn import SyntheticImages

    session = _session(tmp_path, steps, **kw)
    model, opt = _model()
    session.init_process_group()
    session.attach(model, opt)
    session.restore()
    return session, model, SyntheticImages(DATASET, 5, augment=True)


def _params(model: Any) -> list[np.ndarray]:
    """The trained parameters (a forward moves BatchNorm's running statistics)."""
    return [p.numpy().copy() for p in model.parameters() if not p.stop_gradient]


def _loss(model: Any, x: Any, y: Any, reduction: Any = "mean") -> Any:
    import paddle

    return paddle.nn.functional.cross_entropy(model(x), y, reduction=reduction)


# -- the order of calls ---------------------------------------------------------------------


def test_calls_out_of_order_say_what_to_do(tmp_path: Path) -> None:
    session = _session(tmp_path, 1)
    model, opt = _model()
    with pytest.raises(UsageError, match=r"before session\.restore"):
        session.step(None)
    with pytest.raises(UsageError, match=r"restore\(\) before session.init_process_group"):
        session.restore()
    session.init_process_group()
    with pytest.raises(UsageError, match="called twice"):
        session.init_process_group()
    with pytest.raises(UsageError, match=r"before session\.attach"):
        session.restore()
    session.attach(model, opt)
    with pytest.raises(UsageError, match=r"attach\(\) was called twice"):
        session.attach(model, opt)
    session.restore()
    with pytest.raises(UsageError, match="called twice"):
        session.restore()
    x = np.zeros((1, 3, 8, 8), dtype=np.float32)
    for mb in session.plans():
        import paddle

        xs = paddle.to_tensor(np.repeat(x, len(mb.local_indices), axis=0))
        session.step(_loss(model, xs, paddle.zeros([len(mb.local_indices)], dtype="int64")))
    with pytest.raises(UsageError, match=r"after the last step \(1\).*session.finish"):
        session.step(None)
    session.finish()
    with pytest.raises(UsageError, match=r"after session\.finish"):
        session.step(None)
    with pytest.raises(UsageError, match=r"after session\.finish"):
        session.finish()


def test_attach_after_the_group_still_warms_a_prepared_workers_optimizer(
    tmp_path: Path,
) -> None:
    # The order docs/trainer.md shows (group, then attach) used to skip the warm-up that
    # train_mlp.py's order (attach, then group) got.
    session = _session(tmp_path, 1, env=DistEnv(prepared=True))
    model, opt = _model()
    before = _params(model)
    session.init_process_group()
    assert not session._optimizer_warmed
    session.attach(model, opt)
    assert session._optimizer_warmed
    for a, b in zip(before, _params(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_warm_up_before_attach_leaves_no_gradients_for_the_first_step(
    tmp_path: Path,
) -> None:
    import paddle

    session = _session(tmp_path, 1)
    model, opt = _model()

    def grads() -> float:
        return sum(float(p.grad.abs().sum()) for p in model.parameters() if p.grad is not None)

    session._warm_up(lambda: model(paddle.ones([2, 3, 8, 8])).mean().backward())
    assert grads() > 0
    session.attach(model, opt)
    assert grads() == 0


# -- the loss -------------------------------------------------------------------------------


def _first_batch(session: Any, ds: Any) -> tuple[Any, Any]:
    import paddle

    mb = session.current
    return (
        paddle.to_tensor(ds.x[mb.local_indices]),
        paddle.to_tensor(ds.y[mb.local_indices]),
    )


def test_a_summed_loss_is_refused_before_any_parameter_changes(tmp_path: Path) -> None:
    session, model, ds = _ready(tmp_path, virtual_ranks=2)
    before = _params(model)
    next(iter(session.plans()))
    x, y = _first_batch(session, ds)
    with pytest.raises(LossContractError, match="older form"):
        session.step(_loss(model, x, y, "sum") / BATCH)
    with pytest.raises(LossContractError, match="SumGradNode"):
        session.step(_loss(model, x, y, "sum"))
    with pytest.raises(LossContractError, match="ScaleGradNode"):
        session.step(_loss(model, x, y) * 0.5)
    with pytest.raises(LossContractError, match="shape"):
        session.step(_loss(model, x[:2], y[:2], "none"))
    import paddle

    nll = paddle.nn.functional.nll_loss(paddle.nn.functional.log_softmax(model(x)), y)
    with pytest.raises(LossContractError, match="NllLossGradNode"):
        session.step(nll)
    for a, b in zip(before, _params(model), strict=True):
        np.testing.assert_array_equal(a, b)
    assert session.step_done == 0
    # A mean plus a weighted auxiliary mean is a mean over the batch: accepted.
    out = model(x)
    aux = paddle.nn.functional.cross_entropy(out, y) + 0.1 * (out**2).mean()
    assert session.step(aux) is None


def test_per_sample_losses_make_the_same_steps_as_the_mean(tmp_path: Path) -> None:
    runs = {}
    for reduction in ("mean", "none"):
        session, model, ds = _ready(tmp_path / reduction, 4, virtual_ranks=2)
        losses = []
        for mb in session.plans():
            import paddle

            x = paddle.to_tensor(ds.x[mb.local_indices])
            y = paddle.to_tensor(ds.y[mb.local_indices])
            if (g := session.step(_loss(model, x, y, reduction))) is not None:
                losses.append(g)
        runs[reduction] = (losses, _params(model))
    np.testing.assert_allclose(runs["none"][0], runs["mean"][0], rtol=1e-6)
    for a, b in zip(runs["none"][1], runs["mean"][1], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# -- the batch delivered --------------------------------------------------------------------


def test_a_dataloader_without_the_session_sampler_stops_at_step_1(tmp_path: Path) -> None:
    import paddle

    session, model, ds = _ready(tmp_path)
    before = _params(model)
    loader = paddle.io.DataLoader(ds, batch_size=BATCH, shuffle=True)
    x, y, _ = next(iter(loader))
    with pytest.raises(BatchMismatch, match=rf"step 1 .*{FORGOTTEN_SAMPLER}"):
        session.step(_loss(model, x, y))
    for a, b in zip(before, _params(model), strict=True):
        np.testing.assert_array_equal(a, b)
    # The same when the batch carries its ids: they are not the planned ones.
    with pytest.raises(BatchMismatch, match=FORGOTTEN_SAMPLER):
        session.step(_loss(model, x, y), indices=_)
    assert not read_jsonl(tmp_path / "logs" / "samples-rank0-g0.jsonl")


def test_the_sample_log_records_the_batches_the_loader_delivered(tmp_path: Path) -> None:
    session, model, ds = _ready(tmp_path, 3, virtual_ranks=2)
    delivered = []
    for x, y, idx in session.data_loader(ds, num_workers=0):
        delivered.append(idx.numpy().tolist())
        session.step(_loss(model, x, y), indices=idx)
    session.finish()
    logged = [r["ids"] for r in read_jsonl(tmp_path / "logs" / "samples-rank0-g0.jsonl")]
    assert logged == [
        delivered[0] + delivered[1],
        delivered[2] + delivered[3],
        delivered[4] + delivered[5],
    ]


def test_a_batch_out_of_turn_is_refused() -> None:
    from tide.trainer.sampler import ResumableSampler, SamplerConfig, micro_batches

    sampler = ResumableSampler(SamplerConfig(DATASET, BATCH, 0))
    first, second = micro_batches(sampler.plan(1, 0, 1), 0, 1, virtual_ranks=2)
    d = Deliveries()
    d.start()
    d.drawn(1, 1, [int(i) for i in second.local_indices])
    with pytest.raises(BatchMismatch, match="once for every batch"):
        d.check(first)


# -- random streams -------------------------------------------------------------------------


def test_a_samples_augmentation_depends_on_its_epoch_and_id_only() -> None:
    import paddle

    from tide.trainer.dataloader import PlannedBatch

    def draws(batch: PlannedBatch) -> dict[int, float]:
        return {
            i: float(paddle.rand([1]).numpy()[0]) + np.random.rand() + random.random()
            for i in batch
        }

    a = draws(PlannedBatch((3, 7, 9), 5, 0, 1, 0, None))
    b = draws(PlannedBatch((9, 1), 5, 0, 1, 4, None))
    c = draws(PlannedBatch((9,), 5, 1, 1, 0, None))
    assert a[9] == b[9]
    assert a[9] != c[9], "another epoch draws again"


def test_a_fetch_in_the_loader_thread_waits_its_turn_and_leaves_the_loops_rng_alone() -> None:
    import threading

    import paddle

    from tide.trainer.dataloader import PlannedBatch

    d = Deliveries()
    run = d.start()
    paddle.seed(11)
    expected = paddle.rand([3]).numpy()
    paddle.seed(11)
    fetched: list[int] = []
    batch = PlannedBatch((2, 4), 5, 0, run, 1, d)
    t = threading.Thread(target=lambda: fetched.extend(batch))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not fetched, "batch 1 was fetched before batch 0 was stepped"
    d.stepped()
    t.join(10)
    assert fetched == [2, 4]
    np.testing.assert_array_equal(paddle.rand([3]).numpy(), expected)
