"""A pipeline-parallel job in real processes over gloo, without a coordinator
(tide/trainer/examples/train_pipeline_parallel.py): it trains as the unsplit model does (the
tensor-parallel example's, from the same weights), its stages alone or each split by tensor
parallelism, and its guarantees that cannot hold fail
loudly on the rank at fault (a stage that steps without the session's sampler, though it reads
no inputs of the batch; a loss passed on a stage before the last). Its resizes:
test_tensor_parallel_resize.py's pipeline kind."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

from tide.services.testing.localjob import ROOT, gloo_env, reference_run
from tide.services.testing.parity import final_losses, max_rel_array_diff, max_rel_loss_diff
from tide.services.testing.ports import free_port
from tide.trainer import template

pytestmark = [pytest.mark.integration, pytest.mark.paddle]

EXAMPLES = ROOT / "tide" / "trainer" / "examples"
TRAIN = [
    "--dataset-size", "96",
    "--global-batch", "16",
    "--seed", "5",
    "--steps", "14",
    "--hidden", "16",
]  # fmt: skip


def _whole(logs: Path) -> dict[str, np.ndarray]:
    """The unsplit model's parameters and optimizer slots from a run's final slices: the
    stages' layers side by side, a tensor group's shares put together (fc1 by columns, fc2's
    weight by rows; fc2's bias and the beta powers are the same on every share)."""
    parts = [np.load(f) for f in sorted(logs.glob("final-slice-*.npz"))]
    out: dict[str, np.ndarray] = {}
    for key in sorted({k for p in parts for k in p.files}):
        arrays = [p[key] for p in parts if key in p.files]
        if len(arrays) == 1 or "pow_acc" in key or "fc2.bias" in key:
            out[key] = arrays[0]
        else:
            out[key] = np.concatenate(arrays, axis=1 if "fc1.weight" in key else 0)
    return out


@pytest.fixture(scope="module")
def tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model split by tensor parallelism over 2 ranks: run once."""
    return reference_run(
        tmp_path_factory.mktemp("tp"), TRAIN, 2, example=str(EXAMPLES / "train_tensor_parallel.py")
    )


@pytest.mark.timeout(240)
def test_two_pipeline_replicas_train_as_one_through_an_epoch_tail_of_one_sample(
    tmp_path: Path,
) -> None:
    """Each stage's gradients summed over its data-parallel group: 2 replicas (4 ranks) train
    as 1 (2 ranks) does, through steps whose last batch holds one sample, so that the second
    replica runs a padding micro-batch on both stages (37 samples, batches of 12)."""
    args = ["--dataset-size", "37", "--global-batch", "12", *TRAIN[4:]]
    example = str(EXAMPLES / "train_pipeline_parallel.py")
    one = reference_run(tmp_path / "one", args, 2, example=example)
    two = reference_run(tmp_path / "two", args, 4, example=example)
    loss_diff = max_rel_loss_diff(final_losses(two), final_losses(one))
    state_diff = max_rel_array_diff(_whole(two), _whole(one))
    print(f"pipeline, 2 replicas vs 1: loss {loss_diff:.2e}, state {state_diff:.2e}")
    assert len(final_losses(two)) == 14
    assert loss_diff <= 1e-5
    assert state_diff <= 1e-5


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mp_degree", [1, 2])
def test_a_pipeline_trains_as_the_tensor_parallel_split_of_the_same_model(
    tmp_path: Path, tensor_parallel: Path, mp_degree: int
) -> None:
    """Every gradient of the pipeline's stages, from the last stage's weighted loss back
    through the sent gradient, is the unsplit model's: the same losses, parameters and
    optimizer slots as tensor parallelism by hand from the same full weights. With
    mp_degree 2 each stage is split by tensor parallelism too (2 x 2 ranks)."""
    pp = reference_run(
        tmp_path / "pp",
        [*TRAIN, f"--mp-degree={mp_degree}"],
        2 * mp_degree,
        example=str(EXAMPLES / "train_pipeline_parallel.py"),
    )
    assert len(list(pp.glob("final-slice-pp*.npz"))) == 2 * mp_degree
    loss_diff = max_rel_loss_diff(final_losses(pp), final_losses(tensor_parallel))
    state_diff = max_rel_array_diff(_whole(pp), _whole(tensor_parallel))
    print(
        f"pipeline (mp {mp_degree}) vs tensor parallel: loss {loss_diff:.2e}, "
        f"state {state_diff:.2e}"
    )
    assert len(final_losses(pp)) == 14
    assert loss_diff <= 1e-5
    assert state_diff <= 1e-5


# The example's two stages, with one misuse chosen by argv[2] on the stage argv[1] names.
SCRIPT = """
import sys

import paddle

from tide.trainer import ElasticSession, SessionConfig
from tide.trainer.examples.train_mlp import make_dataset
from tide.trainer.examples.train_pipeline_parallel import build_stage
from tide.trainer.layout import ModelParallel

at, misuse = int(sys.argv[1]), sys.argv[2]
session = ElasticSession.from_env(SessionConfig(
    dataset_size=32, global_batch=8, seed=0, max_steps=4, checkpoint_dir=sys.argv[3],
    model_parallel=ModelParallel(pp_degree=2)))
x, y = make_dataset(32, 0)
session.init_process_group()
net = build_stage(session.layout.coord.pp, 8, 0)
session.attach(net, paddle.optimizer.SGD(parameters=net.parameters()))
session.restore()
pipe = session.pipeline
at_fault = session.layout.coord.pp == at
plans = range(4) if at_fault and misuse == "own-batches" else session.plans()
for mb in plans:
    mb = session.current if isinstance(mb, int) else mb
    if pipe.first:
        out = net(paddle.to_tensor(x[mb.local_indices]))
        if at_fault and misuse == "loss-on-first":
            session.step(out.mean())
        pipe.send(out)
        session.step()
    else:
        received = pipe.recv()
        if at_fault and misuse == "detached-input":
            received = received.detach()
        loss = paddle.nn.functional.cross_entropy(
            net(received), paddle.to_tensor(y[mb.local_indices]))
        session.step(loss)
session.finish()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("stage", "misuse", "named", "peer_named"),
    [
        # The last stage reads its labels, the first only the activations it is sent: both
        # step through the session, whose batch check runs on every stage.
        (0, "own-batches", "no batch of this step came from session.batch_sampler()", ""),
        (1, "own-batches", "no batch of this step came from session.batch_sampler()", ""),
        (0, "loss-on-first", "session.step(loss) on stage 0 of 2", ""),
        # The earlier stage would train on zeros: it fails too, naming the cause.
        (
            1,
            "detached-input",
            "got no gradient in micro-batch 0 of step 1",
            "rank 1 failed micro-batch 0 of step 1 instead of sending the gradient",
        ),
    ],
    ids=["first-own-batches", "last-own-batches", "loss-on-first", "detached-input"],
)
def test_a_stage_s_misuse_fails_loudly_on_that_stage(
    tmp_path: Path, stage: int, misuse: str, named: str, peer_named: str
) -> None:
    script = tmp_path / "stages.py"
    script.write_text(SCRIPT)
    ports = [free_port() for _ in range(2)]
    procs, logs = [], []
    try:
        for rank in range(2):
            logs.append(tmp_path / f"rank{rank}.log")
            with open(logs[-1], "wb") as out:
                procs.append(
                    template.popen(
                        [sys.executable, str(script), str(stage), misuse, str(tmp_path / "c")],
                        cwd=str(ROOT),
                        env={**os.environ, **gloo_env(rank, ports)},
                        stdout=out,
                        stderr=out,
                    )
                )
        # One replica: rank == stage. The rank at fault ends by itself.
        code = procs[stage].wait(timeout=90)
        peer_code = procs[1 - stage].wait(timeout=90) if peer_named else None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = logs[stage].read_text(errors="replace")
    assert code != 0, text[-2000:]
    assert named in text, text[-2000:]
    if peer_named:
        peer = logs[1 - stage].read_text(errors="replace")
        assert peer_code != 0, peer[-2000:]
        assert peer_named in peer, peer[-2000:]
