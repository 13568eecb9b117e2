"""One rank of tests/trainer/test_transfer_newcomers.py: ranks 0 and 1 are stayers (a
handover in their own "pod's" memory), ranks 2 and 3 newcomers. Each phase restores one step
through tide/trainer/restore.py with other transfer settings, and counts the bytes this process's
TCP sockets received meanwhile (the kernel's count, ``ss``), so that what a stayer received
is measured, not what the code says it received."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import paddle.distributed as dist
import xxhash

from tide.trainer.checkpoint import CheckpointStore
from tide.trainer.gloo_groups import share_world_context
from tide.trainer.handover import ShmHandover
from tide.trainer.rawstate import StateFiles
from tide.trainer.restore import locate
from tide.trainer.transfer import FAULT_ENV, TransferSettings

STATE_MB = 8
# (phase, step, settings): chunks of 1 MB, so that every sender has several.
PHASES = (
    ("two_senders", 5, TransferSettings(chunk_mb=1, group_min_mb=0, senders_max=2)),
    ("one_sender", 6, TransferSettings(chunk_mb=1, group_min_mb=0, senders_max=1)),
    ("whole_group", 7, TransferSettings(chunk_mb=1, group_min_mb=STATE_MB * 4, senders_max=2)),
    ("flip", 8, TransferSettings(chunk_mb=1, group_min_mb=0, senders_max=2)),
)


def state(step: int, rank: int) -> StateFiles:
    """The arrays every replica holds alike; small files of the rank's own (an RNG state)."""
    rng = np.random.default_rng(step)
    arrays = {
        "model/w": rng.standard_normal(STATE_MB * 2**18).astype(np.float32),
        "opt/m": rng.integers(0, 9, 1000, dtype=np.int64),
        "opt/empty": np.zeros((0, 3), np.float32),
    }
    return StateFiles({"rng.pickle": b"rng-%d-of-rank-%d" % (step, rank)}, arrays)


def digests(files: Any) -> dict[str, str]:
    return {
        k: xxhash.xxh3_64_hexdigest(np.ascontiguousarray(v).tobytes())
        for k, v in files.arrays.items()
    }


def received_bytes() -> dict[str, int]:
    """bytes_received of each TCP socket of this process, by its local and peer address."""
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    out: dict[str, int] = {}
    lines = text.splitlines()
    for head, info in itertools.pairwise(lines):
        if f"pid={os.getpid()}," not in head:
            continue
        got = re.search(r"bytes_received:(\d+)", info)
        out[" ".join(head.split()[3:5])] = int(got.group(1)) if got else 0
    return out


def main() -> int:
    root = Path(sys.argv[1])
    rank, world = int(os.environ["PADDLE_TRAINER_ID"]), int(os.environ["PADDLE_TRAINERS_NUM"])
    dist.init_parallel_env()
    share_world_context()
    store = CheckpointStore(root / "ckpt")
    if rank == 0:
        store.write(3, state(3, 0), {})
    handover = ShmHandover(root / f"shm-{rank}") if rank < 2 else None
    out = []
    for phase, step, settings in PHASES:
        if handover is not None:
            handover.put(step, state(step, rank), {})
        os.environ[FAULT_ENV] = "flip" if phase == "flip" and rank == 2 else ""
        dist.barrier()
        before = received_bytes()
        got = locate(handover, store, rank, world, settings)
        after = received_bytes()
        out.append(
            {
                "phase": phase,
                "step": got.step,
                "source": got.source,
                "intact": got.transfer_intact,
                "senders": got.transfer_senders,
                "digests": digests(got.files),
                "expected": digests(state(step, 0)),
                "rng": got.files["rng.pickle"].decode(),
                "durable": store.list_steps(),
                "socket_bytes": sum(n - before.get(k, 0) for k, n in after.items()),
                "state_bytes": sum(a.nbytes for a in state(step, 0).arrays.values()),
            }
        )
        # Not counted in the next phase's bytes: the agreement of this one's.
        dist.barrier()
    (root / f"result-{rank}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
