"""The training script of bench/statesize.py: tide/trainer/examples/train_mlp.py's MLP with
``--state-mb`` MB of extra state per rank.

The extra state is a persistable buffer (``ballast``, float32) that every step changes (one
block of it, from the step number), so its bytes are real state that a resize must move
exactly, while a step costs what the small MLP's costs: a model whose *trained* state were
1 GB would take seconds per step on this machine's two cores. At the end rank 0 writes the
MLP's parameters and the ballast's digest (``final_params.npz``) for the parity check.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import xxhash

from tide.trainer.examples.train_mlp import build_model, make_dataset, parse_args, session_config
from tide.trainer.session import ElasticSession

BLOCK = 4096


class Sized(paddle.nn.Layer):
    def __init__(self, hidden: int, state_mb: float) -> None:
        super().__init__()
        self.mlp = build_model(hidden)
        n = max(BLOCK, int(state_mb * 2**20) // 4)
        self.register_buffer("ballast", paddle.zeros([n], dtype="float32"), persistable=True)

    def forward(self, x: paddle.Tensor) -> Any:
        return self.mlp(x)

    def _block(self, step: int) -> int:
        return (step * BLOCK) % (int(self.ballast.shape[0]) - BLOCK + 1)

    def touch(self, step: int) -> None:
        """The step's change to the ballast: one block, in place."""
        i = self._block(step)
        view: Any = np.from_dlpack(self.ballast)
        view[i : i + BLOCK] += np.float32(step)

    def ballast_is(self, step: int) -> bool:
        """Whether the ballast is exactly what steps 1..step made of zeros. Before the
        blocks wrap around, without a second copy of a large buffer: every touched block
        compared, every other element zero."""
        view = np.from_dlpack(self.ballast)
        n = int(view.shape[0])
        if (step + 1) * BLOCK > n - BLOCK + 1:
            expected = np.zeros(n, np.float32)
            for k in range(1, step + 1):
                i = self._block(k)
                expected[i : i + BLOCK] += np.float32(k)
            return bool(np.array_equal(view, expected))
        blocks = {self._block(k): np.float32(k) for k in range(1, step + 1)}
        if any(not np.all(view[i : i + BLOCK] == v) for i, v in blocks.items()):
            return False
        return int(np.count_nonzero(view)) == BLOCK * len(blocks)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    argv = sys.argv[1:]
    state_mb = 1.0
    if "--state-mb" in argv:
        i = argv.index("--state-mb")
        state_mb = float(argv[i + 1])
        del argv[i : i + 2]
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    session = ElasticSession.from_env(session_config(args))
    x_all, y_all = make_dataset(args.dataset_size, args.seed)
    paddle.seed(args.seed)
    model = Sized(args.hidden, state_mb)
    lr = paddle.optimizer.lr.StepDecay(learning_rate=args.lr, step_size=50, gamma=0.5)
    optimizer = paddle.optimizer.Adam(learning_rate=lr, parameters=model.parameters())
    session.attach(model, optimizer, lr)

    def warmup() -> None:
        logits = model(paddle.to_tensor(x_all[:8]))
        paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y_all[:8])).backward()

    session.init_process_group(warmup=warmup)
    # What the restore adds to this process's peak memory (the bench's memory figure).
    before_mb = _rss_mb()
    restored = session.restore()
    peak_mb = _rss_mb()
    checked = False
    for mb in session.plans():
        logits = model(paddle.to_tensor(x_all[mb.local_indices]))
        loss = paddle.nn.functional.cross_entropy(logits, paddle.to_tensor(y_all[mb.local_indices]))
        if mb.last:
            # Before the step's end: a checkpoint at this step holds the change.
            model.touch(mb.step)
        session.step(loss)
        if mb.last and not checked and args.log_dir:
            # After the first step, so that the pause measured does not include the check.
            checked = True
            record = {
                "gen": session.env.generation,
                "rank": session.rank,
                "restored_step": restored,
                "ballast_ok": model.ballast_is(mb.step),
                "before_mb": round(before_mb, 1),
                "peak_mb": round(peak_mb, 1),
            }
            with open(Path(args.log_dir) / "restore.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
        if mb.last and args.step_delay_s:
            time.sleep(args.step_delay_s)
    session.finish()
    if args.log_dir and session.rank == 0:
        params = {k: v.numpy() for k, v in model.mlp.state_dict().items()}
        ballast: Any = np.from_dlpack(model.ballast)
        digest = xxhash.xxh3_64_intdigest(ballast)
        params["ballast_xxh3"] = np.array([digest], dtype=np.uint64)
        np.savez(Path(args.log_dir) / "final_params.npz", **params)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
