"""The per-step logs a session writes when ``log_dir`` is set (tests and benchmarks read them).

- ``samples-rank{r}-g{g}.jsonl``: the sample ids every rank trained on, per step;
- ``loss.jsonl`` (rank 0): the global loss of every step, with its wall time;
- ``timings.jsonl``: where a pause went, seen from each rank (first step, held).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import IO, Any


class StepLog:
    def __init__(self, log_dir: str) -> None:
        self._dir = Path(log_dir) if log_dir else None
        self._samples: IO[str] | None = None
        self._loss: IO[str] | None = None

    def open(self, rank: int, generation: int) -> None:
        """This worker knows its rank and generation: open its files."""
        if self._dir is None:
            return
        self._dir.mkdir(parents=True, exist_ok=True)
        self._samples = open(self._dir / f"samples-rank{rank}-g{generation}.jsonl", "a")  # noqa: SIM115
        if rank == 0:
            self._loss = open(self._dir / "loss.jsonl", "a")  # noqa: SIM115

    def step(
        self,
        step: int,
        epoch: int,
        generation: int,
        rank: int,
        world: int,
        ids: list[int],
        loss: float,
    ) -> None:
        if self._samples is not None:
            sample: dict[str, Any] = {"step": step, "epoch": epoch, "gen": generation}
            sample |= {"rank": rank, "world": world, "ids": ids}
            self._samples.write(json.dumps(sample) + "\n")
            self._samples.flush()
        if self._loss is not None:
            line = {"step": step, "loss": loss, "gen": generation, "world": world, "t": time.time()}
            self._loss.write(json.dumps(line) + "\n")
            self._loss.flush()

    def timing(self, event: str, generation: int, rank: int, **fields: Any) -> None:
        """One line of timings.jsonl."""
        if self._dir is None:
            return
        record = {"event": event, "gen": generation, "rank": rank, **fields}
        with open(self._dir / "timings.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        for f in (self._samples, self._loss):
            if f is not None:
                f.close()
        self._samples = self._loss = None
