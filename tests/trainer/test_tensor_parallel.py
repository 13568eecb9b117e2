"""A tensor-parallel job's layout as the session reads it (tide/trainer/layout.py RankLayout,
all_groups, plan_slices), its state's layout file (tide/trainer/slices.py), and what is refused
(SessionConfig, tide/trainer/sharding.py). The training itself: test_tensor_parallel_resize.py."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.trainer.queue_channel import QueueChannel
from tide.base.errors import ConfigError
from tide.trainer import sharding
from tide.trainer.checkpoint import CheckpointSettings, CheckpointStore
from tide.trainer.handover import ShmHandover
from tide.trainer.layout import (
    ModelParallel,
    RankLayout,
    SliceHolding,
    all_groups,
    plan_slices,
)
from tide.trainer.messages import Held
from tide.trainer.session import DistEnv, ElasticSession, SessionConfig
from tide.trainer.slices import layout_file, read_layout

pytestmark = [pytest.mark.unit, pytest.mark.paddle]

MP2 = ModelParallel(mp_degree=2)


def test_a_rank_knows_its_replica_groups_and_store() -> None:
    three = RankLayout(MP2, 4, 3)
    assert (three.dp_rank, three.dp_degree, three.coord.mp) == (1, 2, 1)
    assert three.dp_ranks == [1, 3]
    assert three.tensor_ranks == three.replica_ranks == [2, 3]
    assert not three.writes_durable and not three.logs_samples
    one = RankLayout(MP2, 4, 1)
    assert one.writes_durable and not one.logs_samples
    assert one.slice_name == three.slice_name == "slice-pp0-sep0-mp1"
    assert RankLayout(MP2, 4, 2).logs_samples
    with pytest.raises(ConfigError, match="replica_multiple to 2"):
        RankLayout(MP2, 3, 0)


def test_every_rank_lists_the_same_groups_dp_first_without_singletons() -> None:
    assert all_groups(4, MP2) == [[0, 2], [1, 3], [0, 1], [2, 3]]
    # One replica: no data-parallel group of more than one rank.
    assert all_groups(2, MP2) == [[0, 1]]
    groups = all_groups(8, ModelParallel(mp_degree=4))
    for rank in range(8):
        me = RankLayout(ModelParallel(mp_degree=4), 8, rank)
        assert me.dp_ranks in groups and me.tensor_ranks in groups


def test_a_grow_keeps_the_stayers_and_sends_each_newcomer_its_tensor_rank() -> None:
    held = [SliceHolding(5, 0, 2), SliceHolding(5, 1, 2), SliceHolding(0), SliceHolding(0)]
    plan = plan_slices(held, MP2)
    assert (plan.step, plan.keeps, dict(plan.sends)) == (5, (0, 1), {0: (2,), 1: (3,)})


def test_stayers_renumbered_onto_other_slices_swap_them() -> None:
    # New rank 0 (tensor rank 0) held old rank 3 (tensor rank 1), new rank 1 old rank 2.
    plan = plan_slices([SliceHolding(9, 3, 4), SliceHolding(9, 2, 4)], MP2)
    assert (plan.step, plan.keeps, dict(plan.sends)) == (9, (), {1: (0,), 0: (1,)})


@pytest.mark.parametrize(
    "held",
    [
        # Both stayers held tensor rank 0: nobody holds tensor rank 1 in memory.
        [SliceHolding(9, 2, 4), SliceHolding(9, 0, 4)],
        # Holders of the newest step from two old worlds: not one generation's state.
        [SliceHolding(9, 0, 2), SliceHolding(9, 1, 4)],
        # Nothing in memory (a crash).
        [SliceHolding(0), SliceHolding(0)],
    ],
    ids=["a-slice-missing", "two-old-worlds", "none"],
)
def test_memory_that_cannot_serve_every_slice_leaves_it_to_the_stores(
    held: list[SliceHolding],
) -> None:
    assert plan_slices(held, MP2).step == 0


def test_a_state_says_whose_slice_it_is_and_another_layout_is_refused() -> None:
    files = layout_file(RankLayout(MP2, 4, 3))
    back = read_layout(files, RankLayout(MP2, 2, 0))
    assert back is not None and (back.rank, back.world_size, back.coord.mp) == (3, 4, 1)
    assert read_layout({}, RankLayout(MP2, 2, 0)) is None
    with pytest.raises(ConfigError, match="another layout"):
        read_layout(files, RankLayout(ModelParallel(mp_degree=4), 4, 0))


def _config(**kw: Any) -> SessionConfig:
    return SessionConfig(
        dataset_size=64, global_batch=8, seed=0, max_steps=1, checkpoint_dir="c", **kw
    )


PP2 = ModelParallel(pp_degree=2)


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"model_parallel": ModelParallel(sep_degree=2)}, "model_parallel.sep_degree=2"),
        *(
            case
            for mp, name in ((MP2, "mp_degree=2"), (PP2, "pp_degree=2"))
            for case in (
                ({"model_parallel": mp, "sharding_degree_max": 2}, "sharding_degree_max=2"),
                ({"model_parallel": mp, "virtual_ranks": 4}, f"virtual_ranks=4 with {name}"),
                (
                    {"model_parallel": mp, "checkpoint": CheckpointSettings(every_s=30.0)},
                    "every_s=30.0",
                ),
            )
        ),
    ],
)
def test_what_the_session_cannot_run_beside_tensor_or_pipeline_parallelism_is_refused(
    kw: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        _config(**kw)
    assert _config(model_parallel=MP2).model_parallel.group_size == 2
    assert _config(model_parallel=PP2).model_parallel.group_size == 2
    both = ModelParallel(mp_degree=2, pp_degree=2)
    assert _config(model_parallel=both).model_parallel.group_size == 4


def test_the_fleet_strategy_of_a_tensor_parallel_job_has_its_replicas_and_no_sharding() -> None:
    from paddle.distributed import fleet

    api: Any = fleet
    strategy = api.DistributedStrategy()
    strategy.hybrid_configs = {"mp_degree": 2}
    model = sharding.resolve_model_parallel(strategy, ModelParallel())
    assert model == MP2
    configs = sharding.fleet_strategy(6, strategy, 0, model).hybrid_configs
    assert (configs["dp_degree"], configs["mp_degree"], configs["sharding_degree"]) == (3, 2, 1)
    with pytest.raises(sharding.UnsupportedLayout, match="mp_degree=2 in a world of 3"):
        sharding.check_replicas(3, model)
    fresh = api.DistributedStrategy()
    fresh.hybrid_configs = {"mp_degree": 2}
    with pytest.raises(sharding.UnsupportedLayout, match="sharding_degree_max=2"):
        sharding.fleet_strategy(4, fresh, 2, model)
    with pytest.raises(sharding.UnsupportedLayout, match=r"SessionConfig\.model_parallel"):
        sharding.resolve_model_parallel(fresh, ModelParallel(mp_degree=4))
    # The strategy's own sharding degree is refused, not set to 1.
    sharded = api.DistributedStrategy()
    sharded.hybrid_configs = {"mp_degree": 2, "sharding_degree": 2}
    with pytest.raises(sharding.UnsupportedLayout, match="sharding_degree=2 in the strategy"):
        sharding.fleet_strategy(4, sharded, 0, model)


def test_fleet_pipeline_parallelism_is_refused_naming_its_schedule() -> None:
    from paddle.distributed import fleet

    api: Any = fleet
    strategy = api.DistributedStrategy()
    strategy.hybrid_configs = {"pp_degree": 2}
    with pytest.raises(sharding.UnsupportedLayout, match=r"pp_degree=2.*train_batch"):
        sharding.resolve_model_parallel(strategy, ModelParallel())


def _session(tmp_path: Path, world: int = 2, **kw: Any) -> ElasticSession:
    config = SessionConfig(
        dataset_size=64,
        global_batch=8,
        seed=0,
        max_steps=1,
        checkpoint_dir=str(tmp_path / "ckpt"),
        **kw,
    )
    return ElasticSession(
        config,
        DistEnv(rank=0, world_size=world, master="127.0.0.1:1" if world > 1 else ""),
        QueueChannel(),
    )


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"virtual_ranks": 4}, "virtual_ranks=4"),
        ({"sharding_degree_max": 2}, "sharding_degree_max=2"),
        ({"checkpoint": CheckpointSettings(every_s=30.0)}, "every_s=30.0"),
    ],
)
def test_a_strategy_s_mp_degree_is_checked_as_the_config_s(
    tmp_path: Path, kw: dict[str, Any], named: str
) -> None:
    """An mp_degree from the script's strategy reaches the session where the config's does
    (fleet_strategy -> _use_model_parallel): the same refusals."""
    session = _session(tmp_path, **kw)
    with pytest.raises(sharding.UnsupportedLayout, match=named):
        session._use_model_parallel(MP2, form_groups=False)


def test_data_parallel_beside_tensor_parallelism_must_reduce_over_the_slice_s_replicas(
    tmp_path: Path,
) -> None:
    import paddle

    session = _session(tmp_path)
    session._use_model_parallel(MP2, form_groups=False)
    net = paddle.nn.Linear(2, 2)
    wrapped = paddle.DataParallel(net)
    optimizer = paddle.optimizer.SGD(parameters=net.parameters())
    with pytest.raises(sharding.UnsupportedLayout, match=r"over the whole world.*ranks \[0\]"):
        session.attach(wrapped, optimizer)
    # Over this rank's data-parallel group (one replica: rank 0 alone) it is accepted.
    grouped: Any = wrapped
    grouped.group = SimpleNamespace(ranks=[0])
    sharding.check_data_parallel_group(grouped, RankLayout(MP2, 2, 0))
    grouped.group = SimpleNamespace(ranks=[0, 1])
    with pytest.raises(sharding.UnsupportedLayout, match=r"ranks \[0, 1\]"):
        sharding.check_data_parallel_group(grouped, RankLayout(MP2, 2, 0))


def test_a_checkpoint_dir_of_the_other_kind_of_job_is_refused(tmp_path: Path) -> None:
    """A plain job's checkpoints in the root, a model-parallel job's in slice-* stores: each
    would start from scratch on the other's without a word."""
    state = {"meta.json": b"{}"}
    CheckpointStore(tmp_path / "plain" / "ckpt").write(3, state, {"step": 3})
    mp_job = _session(tmp_path / "plain")
    mp_job._use_model_parallel(MP2, form_groups=False)
    with pytest.raises(ConfigError, match=r"checkpoint_dir=.*without model parallelism"):
        mp_job._check_store_layout()
    CheckpointStore(tmp_path / "mp" / "ckpt" / "slice-pp0-sep0-mp0").write(3, state, {"step": 3})
    import paddle

    plain_job = _session(tmp_path / "mp", world=1)
    plain_job.init_process_group()
    net = paddle.nn.Linear(2, 2)
    plain_job.attach(net, paddle.optimizer.SGD(parameters=net.parameters()))
    with pytest.raises(ConfigError, match=r"checkpoint_dir=.*model-parallel job"):
        plain_job.restore()
    # Each on its own kind: nothing refused.
    _session(tmp_path / "plain", world=1)._check_store_layout()
    ok = _session(tmp_path / "mp")
    ok._use_model_parallel(MP2, form_groups=False)
    ok._check_store_layout()


@pytest.mark.parametrize(
    ("rank", "local_rank", "leaving", "handover", "durable"),
    [
        (1, 1, False, "worker-1", False),
        (0, 0, False, "", False),
        (1, 1, True, None, True),
        # Rank 0 leaving too (a named pod): its slice to the store, its held step reported.
        (0, 0, True, None, True),
    ],
)
def test_each_worker_of_a_pod_hands_its_slice_over_and_a_leaving_slice_writer_writes_it(
    tmp_path: Path,
    rank: int,
    local_rank: int,
    leaving: bool,
    handover: str | None,
    durable: bool,
) -> None:
    """Each worker of a model-parallel pod holds a slice of its own: each puts it in a
    handover of its own for the worker at its place in the pod's next generation (the first
    in the pod's directory). A leaving slice writer has no next worker: it makes its slice
    of the held step durable, else it could be nowhere once the worker exits (slices.py's
    fallback reads it there)."""
    session, channel = _pod_worker(tmp_path, rank, local_rank)
    session._send_held(3, 0.0, checkpoint=True, ids=[], leaving=leaving)
    (held,) = _helds(channel)
    assert held.step == 3
    assert (held.checkpoint is not None) == (rank == 0)
    store = CheckpointStore(tmp_path / "ckpt" / f"slice-pp0-sep0-mp{rank}")
    assert store.list_steps() == ([3] if durable else [])
    for place in ("", "worker-1"):
        handed = ShmHandover(tmp_path / "pod0" / place).latest_step()
        assert handed == (3 if place == handover else None), place


@pytest.mark.parametrize(
    ("rank", "code"), [(0, errno.ENOSPC), (1, errno.ENOSPC), (1, errno.ENOMEM), (0, errno.EIO)]
)
def test_a_handover_that_fails_sends_the_slice_to_the_store(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    rank: int,
    code: int,
) -> None:
    """Shared memory full at the hold: a slice writer writes its slice durably instead and
    the hold goes on (rank 0 reports it), loudly; never a worker dead in the pause. Any
    other error (Paddle raises a device's failures as OSError) is raised."""
    session, channel = _pod_worker(tmp_path, rank, local_rank=rank)

    def full(*_: Any) -> None:
        raise OSError(code, os.strerror(code))

    assert session.handover is not None
    monkeypatch.setattr(session.handover, "put", full)
    if code == errno.EIO:
        with pytest.raises(OSError, match="Input/output error"):
            session._send_held(3, 0.0, checkpoint=True, ids=[])
        assert _helds(channel) == []
        return
    session._send_held(3, 0.0, checkpoint=True, ids=[])
    (held,) = _helds(channel)
    assert held.step == 3
    assert (held.checkpoint is not None) == (rank == 0)
    assert CheckpointStore(tmp_path / "ckpt" / f"slice-pp0-sep0-mp{rank}").list_steps() == [3]
    assert "handover of step 3 failed" in caplog.text and "writing it durably" in caplog.text


def _pod_worker(tmp_path: Path, rank: int, local_rank: int) -> tuple[ElasticSession, QueueChannel]:
    """Worker ``local_rank`` of pod 0 (two workers) of an mp 2 job at 2 ranks, attached."""
    import paddle

    config = SessionConfig(
        dataset_size=64, global_batch=8, seed=0, max_steps=1, checkpoint_dir=str(tmp_path / "ckpt")
    )
    env = DistEnv(
        rank=rank,
        world_size=2,
        master="127.0.0.1:1",
        local_rank=local_rank,
        local_size=2,
        handover_dir=str(tmp_path / "pod0"),
    )
    channel = QueueChannel()
    session = ElasticSession(config, env, channel)
    session._use_model_parallel(MP2, form_groups=False)
    net = paddle.nn.Linear(2, 2)
    session.attach(net, paddle.optimizer.SGD(parameters=net.parameters()))
    return session, channel


def _helds(channel: QueueChannel) -> list[Held]:
    sent = []
    while not channel.outbox.empty():
        sent.append(channel.outbox.get_nowait())
    return [m for m in sent if isinstance(m, Held)]
