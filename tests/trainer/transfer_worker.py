"""One rank of tests/trainer/test_transfer.py: ranks 0 and 1 are stayers (a handover in their
own "pod's" memory), rank 2 a newcomer; they restore three times through tide/trainer/restore.py:
from the durable store alone (a crash), from the stayers' memory, and from their memory with
the newcomer flipping a received byte (TIDE_TRANSFER_FAULT)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle.distributed as dist
import xxhash

from tide.trainer import rawstate
from tide.trainer.checkpoint import CheckpointStore
from tide.trainer.handover import ShmHandover
from tide.trainer.rawstate import StateFiles
from tide.trainer.restore import locate
from tide.trainer.transfer import FAULT_ENV, TransferSettings


def state(step: int) -> StateFiles:
    rng = np.random.default_rng(step)
    arrays = {
        "model/w": rng.standard_normal((33, 17)).astype(np.float32),
        "opt/m": rng.integers(0, 9, 1000, dtype=np.int64),
        "opt/empty": np.zeros((0, 3), np.float32),
        "model/flag": np.array(True),
    }
    return StateFiles({"rng.pickle": b"rng-%d" % step}, arrays)


def digests(files: Any) -> dict[str, str]:
    arrays = getattr(files, "arrays", None) or rawstate.decode(files[rawstate.TENSORS])
    return {
        k: xxhash.xxh3_64_hexdigest(np.ascontiguousarray(v).tobytes()) for k, v in arrays.items()
    }


def main() -> int:
    root = Path(sys.argv[1])
    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    dist.init_parallel_env()
    store = CheckpointStore(root / "ckpt")
    if rank == 0:
        store.write(3, state(3), {})
    handover = ShmHandover(root / f"shm-{rank}") if rank < 2 else None
    out = []
    # The newcomer's live tensor of one name: the bytes go straight into it.
    live = {"model/w": np.zeros((33, 17), np.float32)}
    # "disk": nobody holds a step in memory yet (a crash): rank 0 reads the durable store's
    # raw checkpoint and sends its arrays.
    for phase, step in (("disk", 3), ("clean", 5), ("flip", 6)):
        if handover is not None and phase != "disk":
            handover.put(step, state(step), {})
        os.environ[FAULT_ENV] = "flip" if phase == "flip" and rank == 2 else ""
        dist.barrier()
        # Chunks of 1 KiB: every array but the smallest travels in several.
        got = locate(
            handover, store, rank, world, TransferSettings(chunk_mb=1 / 1024), lambda: live
        )
        out.append(
            {
                "phase": phase,
                "step": got.step,
                "source": got.source,
                "intact": got.transfer_intact,
                "digests": digests(got.files),
                "expected": digests(state(step)),
                "rng": got.files["rng.pickle"].decode(),
                "tensors_file": rawstate.TENSORS in got.files,
                "durable": store.list_steps(),
                "live": xxhash.xxh3_64_hexdigest(live["model/w"].tobytes()),
                "live_is_result": getattr(got.files, "arrays", {}).get("model/w")
                is live["model/w"],
            }
        )
    (root / f"result-{rank}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
