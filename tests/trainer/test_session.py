"""The session in one process (world size 1) driven through an in-memory channel."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import pytest

from tests.trainer.queue_channel import QueueChannel
from tide.base.errors import ConfigError
from tide.trainer.checkpoint import CheckpointNotFound, CheckpointSettings, CheckpointStore
from tide.trainer.contract import UsageError
from tide.trainer.messages import (
    CheckpointAt,
    Exit,
    Held,
    Hold,
    Progress,
    Resume,
    Resumed,
    ToLauncher,
    ToWorker,
)
from tide.trainer.session import DistEnv, ElasticSession, SessionConfig, SessionExit

pytestmark = [pytest.mark.integration, pytest.mark.paddle]


def _train(session: ElasticSession, seed: int = 0, warm_optimizer: bool = False) -> list[float]:
    import paddle

    from tide.trainer.examples.train_mlp import build_model, make_dataset

    x, y = make_dataset(session.config.dataset_size, seed)
    paddle.seed(seed)
    model = build_model(16)
    opt = paddle.optimizer.Adam(learning_rate=1e-2, parameters=model.parameters())
    session.attach(model, opt)
    if warm_optimizer:
        # What a prepared worker does ahead: a forward and backward, then the optimizer step.
        session._warm_up(
            lambda: paddle.nn.functional.cross_entropy(
                model(paddle.to_tensor(x[:4])), paddle.to_tensor(y[:4])
            ).backward()
        )
        session._warm_optimizer()
    session.init_process_group()
    session.restore()
    losses = []
    for plan in session.plans():
        idx = plan.local_indices
        loss = paddle.nn.functional.cross_entropy(
            model(paddle.to_tensor(x[idx])), paddle.to_tensor(y[idx])
        )
        global_loss = session.step(loss)
        assert global_loss is not None
        losses.append(global_loss)
    session.finish()
    return losses


def _config(tmp_path: Path, steps: int, every: int = 0) -> SessionConfig:
    return SessionConfig(
        dataset_size=100,
        global_batch=16,
        seed=0,
        max_steps=steps,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint=CheckpointSettings(every_steps=every),
        log_dir=str(tmp_path / "logs"),
    )


def _next_held(outbox: queue.Queue[ToLauncher]) -> Held:
    while True:
        msg = outbox.get(timeout=30)
        if isinstance(msg, Held):
            return msg


def _drive(channel: QueueChannel, then: ToWorker, seen: list[Held]) -> threading.Thread:
    """Paddle's dygraph mode is per thread: train on the main thread, steer from this one."""

    def run() -> None:
        seen.append(_next_held(channel.outbox))
        channel.inbox.put(then)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_step_without_a_loss_is_refused_outside_a_pipeline(tmp_path: Path) -> None:
    """session.step() once took its loss as a required argument; with the default that a
    pipeline's earlier stages use, a forgotten loss would train on nothing."""
    import paddle

    from tide.trainer.examples.train_mlp import build_model

    session = ElasticSession(
        _config(tmp_path, 2), DistEnv(rank=0, world_size=1, master=""), QueueChannel()
    )
    model = build_model(16)
    session.attach(model, paddle.optimizer.Adam(parameters=model.parameters()))
    session.init_process_group()
    session.restore()
    for _ in session.plans():
        with pytest.raises(UsageError, match=r"session.step\(\) without a loss"):
            session.step()
        break


def test_checkpoint_directive_holds_at_the_step_then_resumes(tmp_path: Path) -> None:
    channel = QueueChannel()
    session = ElasticSession(_config(tmp_path, 20), DistEnv(), channel)
    channel.inbox.put(CheckpointAt(directive_id="d1", step=6))
    seen: list[Held] = []
    driver = _drive(channel, Resume(directive_id="d2"), seen)
    losses = _train(session)
    driver.join(timeout=30)
    (held,) = seen
    assert held.step == 6 and held.directive_ids == ("d1",)
    assert held.checkpoint is not None
    assert held.checkpoint.step == 6 and len(held.checkpoint.digest) == 64
    store = CheckpointStore(tmp_path / "ckpt")
    assert store.verify(6)[1] == held.checkpoint.digest
    assert len(losses) == 20
    # "resumed" comes after "held" and before any later step's progress.
    after = []
    while not channel.outbox.empty():
        after.append(channel.outbox.get())
    kinds = [m.TYPE for m in after]
    assert kinds.index(Resumed.TYPE) < next(
        i for i, m in enumerate(after) if isinstance(m, Progress) and m.step == 7
    )
    assert kinds[-1] == "done"


def test_restart_from_checkpoint_continues_the_same_trajectory(tmp_path: Path) -> None:
    straight = _train(ElasticSession(_config(tmp_path / "a", 12), DistEnv(), QueueChannel()))
    first = _train(ElasticSession(_config(tmp_path / "b", 7, every=7), DistEnv(), QueueChannel()))
    second = ElasticSession(_config(tmp_path / "b", 12), DistEnv(restore_step=7), QueueChannel())
    rest = _train(second)
    assert second.restored_step == 7
    assert first + rest == pytest.approx(straight, rel=1e-6)


def test_a_warmed_optimizer_restores_onto_the_same_trajectory(tmp_path: Path) -> None:
    straight = _train(ElasticSession(_config(tmp_path / "a", 12), DistEnv(), QueueChannel()))
    first = _train(ElasticSession(_config(tmp_path / "b", 7, every=7), DistEnv(), QueueChannel()))
    second = ElasticSession(_config(tmp_path / "b", 12), DistEnv(restore_step=7), QueueChannel())
    rest = _train(second, warm_optimizer=True)
    assert first + rest == pytest.approx(straight, rel=1e-6)


def test_a_warmed_optimizer_refuses_to_start_from_scratch(tmp_path: Path) -> None:
    # Its accumulators hold the warm-up step's values: a fresh worker must start instead.
    session = ElasticSession(_config(tmp_path, 5), DistEnv(), QueueChannel())
    with pytest.raises(CheckpointNotFound):
        _train(session, warm_optimizer=True)


def test_rank_0_removes_what_a_crashed_writer_left_when_it_restores(tmp_path: Path) -> None:
    leftover = tmp_path / "ckpt" / "step-00000004.tmp-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "model.pdparams.part").write_bytes(b"torn")
    session = ElasticSession(_config(tmp_path, 3, every=2), DistEnv(), QueueChannel())
    _train(session)
    assert not leftover.exists()
    # Step 3's is the last; step 2's is there unless step 3's superseded it before its
    # write began (the durable writer keeps only the newest waiting snapshot, and starts
    # niced: on a loaded machine it often has not begun by step 3).
    steps = CheckpointStore(tmp_path / "ckpt").list_steps()
    assert steps[-1] == 3 and set(steps) <= {2, 3}


def test_exit_while_holding_raises_session_exit(tmp_path: Path) -> None:
    channel = QueueChannel()
    session = ElasticSession(_config(tmp_path, 20), DistEnv(), channel)
    channel.inbox.put(Hold(directive_id="h"))
    seen: list[Held] = []
    driver = _drive(channel, Exit(), seen)
    with pytest.raises(SessionExit) as info:
        _train(session)
    driver.join(timeout=30)
    assert info.value.code == 0
    (held,) = seen
    assert held.checkpoint is None and held.step == 1


def test_env_and_config_validation() -> None:
    env = DistEnv.from_env(
        {
            "PADDLE_TRAINER_ID": "1",
            "PADDLE_TRAINERS_NUM": "3",
            "PADDLE_MASTER": "h:1",
            "TIDE_GENERATION": "4",
            "TIDE_RESTORE_STEP": "9",
        }
    )
    assert (env.rank, env.world_size, env.generation, env.restore_step) == (1, 3, 4, 9)
    with pytest.raises(ConfigError, match="PADDLE_TRAINER_ID"):
        DistEnv(rank=3, world_size=3, master="h:1")
    with pytest.raises(ConfigError, match="max_steps"):
        SessionConfig(dataset_size=10, global_batch=2, seed=0, max_steps=-1, checkpoint_dir="c")
