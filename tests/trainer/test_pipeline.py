"""A pipeline-parallel job by hand (pp_degree > 1): its layout (tide/trainer/layout.py
pipeline_ranks, all_groups, plan_slices), a stage's checks and message headers
(tide/trainer/pipeline.py), and what is refused beside it (SessionConfig,
tide/trainer/sharding.py). The training itself: test_tensor_parallel_resize.py's pipeline
kind, and test_pipeline_runs.py for the runs in real processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.trainer.queue_channel import QueueChannel
from tide.trainer import sharding
from tide.trainer.contract import UsageError
from tide.trainer.layout import ModelParallel, RankLayout, SliceHolding, all_groups, plan_slices
from tide.trainer.pipeline import Pipeline, backward, header, read_header
from tide.trainer.sampler import MicroBatch
from tide.trainer.session import DistEnv, ElasticSession, SessionConfig

pytestmark = [pytest.mark.unit, pytest.mark.paddle]

PP2 = ModelParallel(pp_degree=2)


def test_a_rank_knows_its_stage_pipeline_and_gradient_group() -> None:
    three = RankLayout(PP2, 4, 3)
    assert (three.dp_rank, three.dp_degree, three.coord.pp) == (1, 2, 1)
    assert three.pipeline_ranks == three.replica_ranks == [2, 3]
    assert three.dp_ranks == [1, 3]
    assert three.tensor_ranks == [3]
    assert three.slice_name == "slice-pp1-sep0-mp0"
    assert not three.writes_durable and not three.logs_samples
    # The first stage of each replica logs its samples (every stage trains on them).
    assert RankLayout(PP2, 4, 2).logs_samples and not RankLayout(PP2, 4, 1).logs_samples
    assert RankLayout(PP2, 4, 1).writes_durable


def test_every_rank_forms_the_pipelines_and_the_adjacent_stages_after_the_other_groups() -> None:
    assert all_groups(4, PP2) == [[0, 2], [1, 3], [0, 1], [2, 3]]
    assert all_groups(2, PP2) == [[0, 1]]
    # Three stages: each pipeline, then each pair of adjacent stages of it.
    assert all_groups(3, ModelParallel(pp_degree=3)) == [[0, 1, 2], [0, 1], [1, 2]]
    both = ModelParallel(mp_degree=2, pp_degree=2)
    groups = all_groups(8, both)
    for rank in range(8):
        me = RankLayout(both, 8, rank)
        assert me.dp_ranks in groups and me.tensor_ranks in groups
        assert me.pipeline_ranks in groups
    assert RankLayout(both, 8, 5).pipeline_ranks == [5, 7]


def test_a_grow_sends_each_newcomer_its_stage_from_a_stayer_at_that_stage() -> None:
    held = [SliceHolding(5, 0, 2), SliceHolding(5, 1, 2), SliceHolding(0), SliceHolding(0)]
    plan = plan_slices(held, PP2)
    assert (plan.step, plan.keeps, dict(plan.sends)) == (5, (0, 1), {0: (2,), 1: (3,)})
    # A whole stage gone from memory: the stores must serve it.
    assert plan_slices([SliceHolding(5, 0, 4), SliceHolding(5, 2, 4)], PP2).step == 0


def _mb(step: int = 3, index: int = 0) -> MicroBatch:
    ids = np.arange(4)
    return MicroBatch(step, 0, 0, 8, ids, ids, 0.5, index, 1)


def _stage(stage: int, mb: MicroBatch | None = None) -> Pipeline:
    current = mb or _mb()
    # The groups' objects only name them here: the tests' broadcast is a Wire's.
    return Pipeline(RankLayout(PP2, 2, stage), {(0, 1): "pipeline"}, lambda: current)


def test_a_message_header_names_its_micro_batch_dtype_and_shape() -> None:
    import paddle

    values = header(_mb(7, 1), paddle.zeros([4, 16], dtype="float32"))
    assert read_header(values) == (7, 1, "float32", [4, 16])
    with pytest.raises(UsageError, match="dtype bool"):
        header(_mb(), paddle.zeros([2], dtype="bool"))
    with pytest.raises(UsageError, match="9 dimensions"):
        header(_mb(), paddle.zeros([1] * 9))


@pytest.mark.parametrize(
    ("stage", "loss", "named"),
    [
        (1, None, r"without a loss on stage 1 of 2.*session.step\(loss\)"),
        (0, 1.0, r"session.step\(loss\) on stage 0 of 2.*last stage only.*pipeline.send"),
        (0, None, r"before session.pipeline.send\(outputs\)"),
        (1, 1.0, r"without session.pipeline.recv\(\)"),
    ],
    ids=["last-without-loss", "first-with-loss", "first-without-send", "last-without-recv"],
)
def test_a_step_without_what_its_stage_s_backward_needs_is_refused(
    stage: int, loss: Any, named: str
) -> None:
    with pytest.raises(UsageError, match=named):
        _stage(stage).check_step(_mb(), loss)


def test_a_stage_sends_and_receives_only_toward_stages_it_has() -> None:
    with pytest.raises(UsageError, match=r"recv\(\) on the first stage"):
        _stage(0).recv()
    with pytest.raises(UsageError, match=r"send\(\) on the last stage.*session.step\(loss\)"):
        _stage(1).send(None)
    first, last = _stage(0), _stage(1)
    assert (first.first, first.last, last.first, last.last) == (True, False, False, True)


def _data_parallel() -> Any:
    """A ``paddle.DataParallel`` (a subclass, as a user's may be) without a process group."""
    import paddle

    class Wrapped(paddle.DataParallel):
        def __init__(self) -> None:  # no group to form: the refusal reads the type
            pass

    return Wrapped()


@pytest.mark.parametrize(
    ("model", "scaler", "fleet_job", "named"),
    [
        (_data_parallel(), None, None, "paddle.DataParallel with pp_degree=2"),
        (object(), object(), None, "an AMP GradScaler with pp_degree=2"),
        (object(), None, object(), "fleet's wrappers with pp_degree=2"),
    ],
    ids=["data-parallel", "scaler", "fleet"],
)
def test_a_pipeline_stage_runs_a_plain_model_without_a_scaler(
    model: Any, scaler: Any, fleet_job: Any, named: str
) -> None:
    with pytest.raises(sharding.UnsupportedLayout, match=named):
        sharding.check_pipeline_attached(PP2, model, scaler, fleet_job)
    sharding.check_pipeline_attached(PP2, object(), None, None)
    sharding.check_pipeline_attached(ModelParallel(mp_degree=2), _data_parallel(), None, None)


def test_fleet_s_pipeline_is_refused_pointing_at_the_pipeline_by_hand() -> None:
    from paddle.distributed import fleet

    api: Any = fleet
    strategy = api.DistributedStrategy()
    strategy.hybrid_configs = {"pp_degree": 2}
    with pytest.raises(
        sharding.UnsupportedLayout, match=r"pp_degree=2.*train_batch.*session.pipeline"
    ):
        sharding.resolve_model_parallel(strategy, ModelParallel())
    # A pipeline by hand has no fleet strategy: fleet_strategy would drop its stages.
    with pytest.raises(sharding.UnsupportedLayout, match="pipeline by hand run without fleet"):
        sharding.fleet_strategy(2, None, 0, PP2)


def test_session_pipeline_needs_a_pipeline(tmp_path: Path) -> None:
    config = SessionConfig(
        dataset_size=64, global_batch=8, seed=0, max_steps=1, checkpoint_dir=str(tmp_path)
    )
    session = ElasticSession(config, DistEnv(rank=0, world_size=1, master=""), QueueChannel())
    with pytest.raises(UsageError, match=r"ModelParallel\(pp_degree=...\)"):
        _ = session.pipeline


class Wire:
    """``paddle.distributed.broadcast`` of one rank, without a world: what this rank sends
    (``src`` its own rank) is recorded, what it receives comes from ``inbox`` in order."""

    def __init__(self, rank: int, inbox: list[np.ndarray]) -> None:
        self.rank = rank
        self.inbox = list(inbox)
        self.sent: list[np.ndarray] = []

    def broadcast(self, tensor: Any, src: int, group: Any = None) -> None:
        if src == self.rank:
            self.sent.append(tensor.numpy().copy())
        else:
            tensor.set_value(self.inbox.pop(0).astype(tensor.numpy().dtype))


def _wired(monkeypatch: pytest.MonkeyPatch, stage: int, inbox: list[np.ndarray]) -> Wire:
    import paddle.distributed as dist

    wire = Wire(stage, inbox)
    monkeypatch.setattr(dist, "broadcast", wire.broadcast)
    return wire


def test_the_last_stage_trains_on_what_it_receives_and_sends_its_gradient_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import paddle

    mb = _mb()
    h = np.arange(6, dtype=np.float32).reshape(2, 3)
    wire = _wired(monkeypatch, 1, [header(mb, paddle.to_tensor(h)), h])
    pipe = _stage(1, mb)
    x = pipe.recv()
    assert not x.stop_gradient and np.array_equal(x.numpy(), h)
    pipe.check_step(mb, 1.0)
    (x * x).sum().backward()
    pipe.send_input_grad(mb)
    sent_header, grad = wire.sent
    assert read_header(sent_header) == (mb.step, mb.index, "float32", [2, 3])
    assert np.array_equal(grad, 2 * h)


def test_a_stage_before_the_last_runs_its_backward_from_the_gradient_it_receives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import paddle

    mb = _mb()
    g = np.full((2, 3), 0.5, dtype=np.float32)
    wire = _wired(monkeypatch, 0, [header(mb, paddle.to_tensor(g)), g])
    pipe = _stage(0, mb)
    w = paddle.to_tensor(np.ones((2, 3), dtype=np.float32), stop_gradient=False)
    out = w * 3.0
    pipe.send(out)
    assert np.array_equal(wire.sent[1], out.numpy())
    pipe.check_step(mb, None)
    outputs, grad = pipe.sent_gradient(mb)
    paddle.autograd.backward([outputs], [grad])
    assert w.grad is not None and np.allclose(w.grad.numpy(), 3.0 * g)
    # The first stage has nothing to send back.
    pipe.send_input_grad(mb)
    assert len(wire.sent) == 2


def test_a_message_for_another_micro_batch_is_refused_naming_both(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import paddle

    h = np.zeros((2, 3), dtype=np.float32)
    _wired(monkeypatch, 1, [header(_mb(9, 0), paddle.to_tensor(h)), h])
    with pytest.raises(
        UsageError,
        match=r"at micro-batch 0 of step 3 received the activation of micro-batch 0 of step 9",
    ):
        _stage(1, _mb(3, 0)).recv()


def test_attach_refuses_a_scaler_on_a_pipeline_stage(tmp_path: Path) -> None:
    import paddle

    config = SessionConfig(
        dataset_size=64, global_batch=8, seed=0, max_steps=1, checkpoint_dir=str(tmp_path)
    )
    env = DistEnv(rank=0, world_size=2, master="127.0.0.1:1")
    session = ElasticSession(config, env, QueueChannel())
    session._use_model_parallel(PP2, form_groups=False)
    net = paddle.nn.Linear(2, 2)
    optimizer = paddle.optimizer.SGD(parameters=net.parameters())
    with pytest.raises(sharding.UnsupportedLayout, match="GradScaler with pp_degree=2"):
        session.attach(net, optimizer, scaler=paddle.amp.GradScaler())


def test_a_padding_batch_leaves_a_stage_s_buffers_as_they_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica with no sample left in a step runs a padding micro-batch: every stage's
    buffers (BatchNorm's running statistics) are put back after it, the first stage's too,
    whose backward runs from the gradient the next stage sends."""
    import paddle

    from tide.trainer.stepper import Stepper

    paddle.seed(0)
    net = paddle.nn.Sequential(paddle.nn.Linear(3, 4), paddle.nn.BatchNorm1D(4))
    stepper = Stepper(
        net,
        paddle.optimizer.SGD(parameters=net.parameters()),
        None,
        None,
        world_size=4,
        virtual_ranks=0,
        seed=0,
        dp_degree=2,
    )
    ids = np.arange(1)
    mb = MicroBatch(1, 0, 0, 1, ids[:1], ids, 0.0, 0, 1, padding=True)
    before = net[1]._mean.numpy().copy()
    stepper.prepare(mb)
    out = net(paddle.to_tensor(np.full((2, 3), 5.0, dtype=np.float32)))
    _wired(monkeypatch, 0, [header(mb, out), np.zeros((2, 4), dtype=np.float32)])
    pipe = _stage(0, mb)
    pipe.send(out)
    pipe.check_step(mb, None)
    backward(stepper, pipe, mb, None)  # what session.step runs
    assert np.array_equal(net[1]._mean.numpy(), before)


def test_a_stage_whose_input_got_no_gradient_fails_and_so_does_the_stage_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A last stage whose loss did not use the tensor it received (detached here) would
    leave the earlier stages untrained without a word: it fails, and the header it sends in
    place of the gradient fails the previous stage too, naming the cause, before that stage's
    backward and step (not a collective's timeout later)."""
    import paddle

    mb = _mb()
    h = np.ones((2, 3), dtype=np.float32)
    wire = _wired(monkeypatch, 1, [header(mb, paddle.to_tensor(h)), h])
    pipe = _stage(1, mb)
    x = pipe.recv()
    w = paddle.to_tensor(np.ones((2, 3), dtype=np.float32), stop_gradient=False)
    (x.detach() * w).sum().backward()
    with pytest.raises(UsageError, match=r"got no gradient.*not detached"):
        pipe.send_input_grad(mb)
    (failed,) = wire.sent  # the header alone: no tensor follows
    _wired(monkeypatch, 0, [failed])
    first = _stage(0, mb)
    first.send(paddle.to_tensor(h))
    with pytest.raises(UsageError, match=r"rank 1 failed micro-batch 0 of step 3.*no gradient"):
        first.sent_gradient(mb)


def test_a_pipeline_stage_needs_each_of_its_groups() -> None:
    with pytest.raises(RuntimeError, match="rank 0: its pipeline group was not formed"):
        Pipeline(RankLayout(PP2, 2, 0), {}, _mb)
    # Three stages: the middle one's pairs are groups of their own.
    pp3 = ModelParallel(pp_degree=3)
    whole_and_prev = {(0, 1, 2): "pipeline", (0, 1): "pair"}
    with pytest.raises(RuntimeError, match="rank 1: its next stage's group was not formed"):
        Pipeline(RankLayout(pp3, 3, 1), whole_and_prev, _mb)
    whole_and_next = {(0, 1, 2): "pipeline", (1, 2): "pair"}
    with pytest.raises(RuntimeError, match="rank 1: its previous stage's group was not formed"):
        Pipeline(RankLayout(pp3, 3, 1), whole_and_next, _mb)
    Pipeline(RankLayout(pp3, 3, 1), {**whole_and_prev, **whole_and_next}, _mb)
