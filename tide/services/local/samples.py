"""Did every sample get consumed exactly once? An audit of the trainer's sample logs.

Each worker appends one line per step to ``samples-rank{r}-g{g}.jsonl`` in the
job's log dir: ``{"step", "epoch", "gen", "rank", "world", "ids"}``. The audit
compares what was logged with what the exact resharding sampler says each
global step must consume (tide/trainer/sampler.py), whatever the world size was:

- every step from 1 to the last one is present, run by one generation only (a
  step run twice is work lost and redone);
- within the generation that ran it, every rank logged it once, and together
  they consumed exactly the step's planned global batch;
- so within an epoch no sample is used twice and none is skipped.

Steps at the very end that not every rank logged (the job was stopped in the
middle of a step) are reported apart and not counted as errors.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tide.base.errors import InvalidArgument

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleAudit:
    last_step: int
    steps_checked: int
    samples: int
    generations: tuple[int, ...]
    # (generation, world size) in order of first step.
    worlds: tuple[tuple[int, int], ...]
    # Steps logged by more than one generation: work that was redone.
    repeated_steps: tuple[int, ...]
    # Steps between 1 and last_step that no generation logged completely.
    missing_steps: tuple[int, ...]
    # Steps whose consumed samples differ from the sampler's plan.
    wrong_steps: tuple[int, ...]
    # Trailing steps some ranks had not logged when the job stopped.
    unfinished_steps: tuple[int, ...]

    @property
    def exactly_once(self) -> bool:
        return (
            self.steps_checked > 0
            and not self.repeated_steps
            and not self.missing_steps
            and not self.wrong_steps
        )

    def summary(self) -> str:
        if self.exactly_once:
            return (
                f"every sample consumed exactly once: {self.samples} samples in"
                f" {self.steps_checked} steps across generations"
                f" {', '.join(f'g{g}×{w}' for g, w in self.worlds)}"
            )
        problems = []
        if self.steps_checked == 0:
            problems.append("no complete step logged")
        for name in ("repeated_steps", "missing_steps", "wrong_steps"):
            steps = getattr(self, name)
            if steps:
                problems.append(f"{name.replace('_', ' ')} {_ranges(steps)}")
        return "sample audit FAILED: " + "; ".join(problems)


def _ranges(steps: tuple[int, ...]) -> str:
    shown = ", ".join(str(s) for s in steps[:8])
    return shown + (f" (+{len(steps) - 8} more)" if len(steps) > 8 else "")


def read_records(log_dir: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    for path in sorted(log_dir.glob("samples-rank*-g*.jsonl")):
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                records.append(
                    {
                        "step": int(rec["step"]),
                        "gen": int(rec["gen"]),
                        "rank": int(rec["rank"]),
                        "world": int(rec["world"]),
                        "ids": [int(i) for i in rec["ids"]],
                    }
                )
            except (ValueError, KeyError, TypeError):
                # A line cut short by a killed worker is the last of its file.
                logger.warning("sample log %s:%d unreadable; skipped", path, n)
    return records


def audit(log_dir: Path, *, dataset_size: int, global_batch: int, seed: int) -> SampleAudit:
    from tide.trainer.sampler import ResumableSampler, SamplerConfig

    if not log_dir.is_dir():
        raise InvalidArgument(f"no sample log directory {log_dir}")
    sampler = ResumableSampler(SamplerConfig(dataset_size, global_batch, seed))
    # step → generation → rank → ids (a rank logging a step twice keeps the last).
    by_step: dict[int, dict[int, dict[int, list[int]]]] = defaultdict(lambda: defaultdict(dict))
    worlds: dict[int, int] = {}
    first_step: dict[int, int] = {}
    for r in read_records(log_dir):
        by_step[r["step"]][r["gen"]][r["rank"]] = r["ids"]
        worlds[r["gen"]] = r["world"]
        first_step[r["gen"]] = min(first_step.get(r["gen"], r["step"]), r["step"])

    def complete(step: int, gen: int) -> bool:
        return len(by_step[step][gen]) == worlds[gen]

    last = max(by_step, default=0)
    # Trailing steps not every rank logged: the job stopped mid-step.
    unfinished: list[int] = []
    top = last
    while top > 0 and top in by_step and not any(complete(top, g) for g in by_step[top]):
        unfinished.append(top)
        top -= 1
    repeated, missing, wrong = [], [], []
    samples = 0
    checked = 0
    for step in range(1, top + 1):
        gens = [g for g in by_step.get(step, {}) if complete(step, g)]
        if not gens:
            missing.append(step)
            continue
        if len(by_step[step]) > 1:
            repeated.append(step)
        gen = max(gens)
        world = worlds[gen]
        got = [i for rank in range(world) for i in by_step[step][gen].get(rank, [])]
        planned = sampler.plan(step, 0, world).global_indices
        if got != [int(i) for i in planned]:
            wrong.append(step)
        samples += len(got)
        checked += 1
    order = sorted(first_step, key=lambda g: (first_step[g], g))
    return SampleAudit(
        last_step=top,
        steps_checked=checked,
        samples=samples,
        generations=tuple(order),
        worlds=tuple((g, worlds[g]) for g in order),
        repeated_steps=tuple(repeated),
        missing_steps=tuple(missing),
        wrong_steps=tuple(wrong),
        unfinished_steps=tuple(sorted(unfinished)),
    )
