"""The trainers users already have (issue 28): PaddleFormers' Trainer, resized, against a
fixed-size run of the same script; and the ``paddle.distributed.launch`` command line.

- ``paddleformers_rel_diff``: tide/trainer/integrations/examples/train_pf_tide.py (a tiny Llama,
  stock ``TrainingArguments``, one import line changed) under a coordinator and launchers
  (tide/services/testing/localjob.py: the scaler's part played by ``Resize`` calls), resized
  2 -> 3 -> 1 -> 2 workers on gloo while it trains, against one fixed 2-worker run of the
  same script in the same benchmark: the largest per-step loss and final-parameter
  difference, relative (tide/services/testing/parity.py). The live run is paced by
  bench/frameworks_paced.py (0.1 s per micro-batch) so that each resize lands mid-run.
- ``exactly_once``: 1 when that run used every sample once per epoch and no step twice.
- ``lost_steps``: the coordinator's count of steps lost to unplanned member losses
  (``lost_steps_total``), plus any step of the budget the run never completed.
- ``resizes``: world-size changes seen in the run's own sample logs.
- ``user_lines_changed``: +/- lines of the diff between the stock script and the Tide one.
- ``launch_args_supported``: ``paddle.distributed.launch`` arguments ``tide.trainer.launch``
  accepts (tide/trainer/integrations/paddle_launch.py), out of ``launch_args_total``.

    .venv-frameworks/bin/python -m bench.frameworks --quick   # the venv make frameworks builds

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import itertools
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.parity import CHAIN, rel_diff
from tide.services.testing.localjob import ROOT, LocalJob, reference_run, resize_along
from tide.services.testing.parity import check_exactly_once, final_losses, worlds_by_generation
from tide.trainer.integrations import paddle_launch

EXAMPLES = ROOT / "tide" / "trainer" / "integrations" / "examples"
STOCK = EXAMPLES / "train_pf_stock.py"
TIDE = EXAMPLES / "train_pf_tide.py"
PACED = str(ROOT / "bench" / "frameworks_paced.py")
DATASET, GLOBAL_BATCH = 256, 8  # as the example script sets them


def script_diff(a: Path, b: Path, context: int = 3) -> list[str]:
    """The unified diff from script ``a`` to script ``b`` (docs/migrate.md prints these)."""
    lines = difflib.unified_diff(
        a.read_text().splitlines(), b.read_text().splitlines(), n=context, lineterm=""
    )
    return [line for line in lines if not line.startswith(("+++", "---"))]


def user_lines_changed(a: Path = STOCK, b: Path = TIDE) -> int:
    """Lines removed or added, blank ones (ruff's import blocks) not counted."""
    return sum(1 for line in script_diff(a, b, 0) if line[:1] in "+-" and line[1:].strip())


async def live(workdir: Path, steps: int, worlds: Sequence[int] = CHAIN) -> tuple[Path, int]:
    """The example under a coordinator, resized along ``worlds`` while it trains: its log
    directory and the coordinator's count of lost steps."""
    job = LocalJob(workdir, ["--steps", str(steps)], heartbeat_timeout_s=10.0, example=PACED)
    return job.log_dir, (await resize_along(job, worlds)).lost_steps


def run(quick: bool, workdir: Path) -> dict[str, Any]:
    steps = 60 if quick else 200
    fixed = reference_run(workdir / "fixed", ["--steps", str(steps)], 2, example=str(TIDE))
    os.environ["TIDE_BENCH_STEP_DELAY_S"] = "0.1"
    resized, lost = asyncio.run(live(workdir / "live", steps))
    result: dict[str, Any] = {"paddleformers_rel_diff": float(f"{rel_diff(resized, fixed):.3g}")}
    try:
        check_exactly_once(resized, DATASET, steps, DATASET // GLOBAL_BATCH)
        result["exactly_once"] = 1
    except AssertionError:
        result["exactly_once"] = 0
    done = set(final_losses(resized))
    result["lost_steps"] = lost + steps - len(done & set(range(1, steps + 1)))
    worlds = [w for _, w in sorted(worlds_by_generation(resized).items())]
    result["resizes"] = sum(a != b for a, b in itertools.pairwise(worlds))
    result["user_lines_changed"] = user_lines_changed()
    result["launch_args_supported"] = len(paddle_launch.ACCEPTED)
    result["launch_args_total"] = len(paddle_launch.ACCEPTED) + len(paddle_launch.REFUSED)
    result["ok"] = (
        result["paddleformers_rel_diff"] <= 1e-5
        and result["exactly_once"] == 1
        and result["lost_steps"] == 0
        and result["resizes"] >= 3
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    ns = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-frameworks-") as tmp:
        result = run(ns.quick, Path(tmp))
    print("RESULT " + json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
