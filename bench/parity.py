"""Is an elastic run the same run? Parity of resized runs against a fixed-size run, and what
the BatchNorm-exact mode costs, on this machine.

Each elastic run here is a chain of fixed-size segments 2 -> 3 -> 1 -> 2 workers on gloo, each
segment fresh processes that restore the previous segment's checkpoint, as the workers of a
new generation do after a resize (the coordinator's part of a resize is measured by
bench/rescale.py and tested end to end in tests/e2e). The baseline, in the same run, is one
fixed 2-worker run of the same script and arguments. A rel diff is the largest of the
per-step loss differences and of the final parameter (and buffer) differences, each relative
to the fixed run's magnitude.

- ``mlp_rel_diff``: tide/trainer/examples/train_mlp.py.
- ``batchnorm_rel_diff``: tide/trainer/examples/train_bn.py (a BatchNorm CNN) with 4 virtual ranks;
  ``batchnorm_plain_rel_diff``: the same without them (per-rank BatchNorm statistics), what
  Tide's exactness promise would be for BatchNorm models otherwise.
- ``dataparallel_rel_diff``: the BatchNorm CNN wrapped in ``paddle.DataParallel`` on the
  chain, against the session's own gradient sum on the fixed run.
- ``dataloader_exactly_once``: 1 when the chain fed by ``paddle.io.DataLoader`` with 2 worker
  processes used every sample once per epoch and no step twice.
- ``crash_loop_generations``: re-forms of a job whose workers die at every start before it is
  FAILED, at most ``crash_loop_budget`` (bench/crashloop.py, which also measures the backoff).
- ``virtual_rank_throughput_ratio``: samples/s with 4 virtual ranks over the plain mode, both
  at 2 workers, same script and batch, median step time after warm-up.
- ``augmentation_rel_diff``: the BatchNorm CNN with 4 virtual ranks, random flips and noise
  drawn from Paddle's RNG inside ``__getitem__`` and 2 DataLoader worker processes, on the
  chain against a fixed run (the session seeds each sample's fetch, tide/trainer/dataloader.py).
- ``loader_workers_deterministic``: 1 when two identical fixed runs of that script are
  bit-identical, with 2 loader workers and with ``num_workers=0`` (the loader's thread).
- ``forgotten_sampler_detected``: 1 when the script with a plain ``DataLoader(shuffle=True)``
  instead of ``session.batch_sampler()`` stops at step 1 naming that cause, no step taken;
  ``summed_loss_refused``: the same for a loss summed and divided by the global batch.

    python -m bench.parity --quick   # short runs, about 3 minutes here
    python -m bench.parity           # longer runs

The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import crashloop
from tide.services.testing.localjob import EXAMPLE, ROOT, loss_records, reference_run
from tide.services.testing.parity import (
    check_exactly_once,
    final_losses,
    max_rel_loss_diff,
    max_rel_param_diff,
)
from tide.trainer.contract import FORGOTTEN_SAMPLER

BN = str(ROOT / "tide" / "trainer" / "examples" / "train_bn.py")
CHAIN = (2, 3, 1, 2)


def chain(workdir: Path, example: str, args: Sequence[str], steps: int) -> Path:
    """A run resized along CHAIN at even step fractions; returns its log directory."""
    cuts = [round(steps * (i + 1) / len(CHAIN)) for i in range(len(CHAIN))]
    log_dir = workdir / "logs"
    for world, until in zip(CHAIN, cuts, strict=True):
        log_dir = reference_run(workdir, [*args, "--steps", str(until)], world, example=example)
    return log_dir


def rel_diff(run: Path, fixed: Path) -> float:
    return max(
        max_rel_loss_diff(final_losses(run), final_losses(fixed)),
        max_rel_param_diff(run / "final_params.npz", fixed / "final_params.npz"),
    )


def parity(workdir: Path, example: str, args: Sequence[str], steps: int) -> float:
    fixed = reference_run(workdir / "fixed", [*args, "--steps", str(steps)], 2, example=example)
    return rel_diff(chain(workdir / "chain", example, args, steps), fixed)


def identical(a: Path, b: Path) -> bool:
    return final_losses(a) == final_losses(b) and rel_diff(a, b) == 0.0


def stops_at_step_1(workdir: Path, args: Sequence[str], cause: str) -> int:
    """1 when the script fails on every rank before its first step, naming ``cause``."""
    try:
        reference_run(workdir, args, 2, example=BN)
    except RuntimeError:
        logs = [(workdir / f"ref-rank{r}.log").read_text() for r in range(2)]
        named = all("step 1 (micro-batch 1" in log and cause in log for log in logs)
        return int(named and not loss_records(workdir / "logs"))
    return 0


def contract(workdir: Path, data: Sequence[str], steps: int) -> dict[str, Any]:
    """The data path's random streams and the checks at step 1 (issue 27)."""
    aug = [*data, "--virtual-ranks", "4", "--augment", "--width", "4"]
    workers = [*aug, "--loader-workers", "2"]
    fixed = reference_run(workdir / "aug-fixed", [*workers, "--steps", str(steps)], 2, example=BN)
    again = reference_run(workdir / "aug-again", [*workers, "--steps", str(steps)], 2, example=BN)
    thread = [*aug, "--steps", str(steps // 2)]
    t1 = reference_run(workdir / "thread-a", thread, 2, example=BN)
    t2 = reference_run(workdir / "thread-b", thread, 2, example=BN)
    short = [*aug, "--steps", "4"]
    return {
        "augmentation_rel_diff": rel_diff(chain(workdir / "aug", BN, workers, steps), fixed),
        "loader_workers_deterministic": int(identical(fixed, again) and identical(t1, t2)),
        "forgotten_sampler_detected": stops_at_step_1(
            workdir / "forgot", [*short, "--forget-sampler"], FORGOTTEN_SAMPLER
        ),
        "summed_loss_refused": stops_at_step_1(
            workdir / "summed", [*short, "--summed-loss"], "older form"
        ),
    }


def step_s(log_dir: Path) -> float:
    """Median wall time between consecutive steps, the first five left out (warm-up)."""
    t = [float(r["t"]) for r in sorted(loss_records(log_dir), key=lambda r: int(r["step"]))]
    return statistics.median(b - a for a, b in itertools.pairwise(t[5:]))


def run(quick: bool, workdir: Path) -> dict[str, Any]:
    steps = 24 if quick else 60
    data = ["--dataset-size", "200", "--global-batch", "32", "--seed", "3"]
    result: dict[str, Any] = {"chain": list(CHAIN), "steps": steps}
    started = time.monotonic()
    result["mlp_rel_diff"] = parity(workdir / "mlp", EXAMPLE, [*data, "--hidden", "16"], steps)
    result["batchnorm_rel_diff"] = parity(
        workdir / "bn", BN, [*data, "--virtual-ranks", "4"], steps
    )
    result["batchnorm_plain_rel_diff"] = parity(workdir / "bn-plain", BN, data, steps)
    fixed = reference_run(
        workdir / "dp-fixed", [*data, "--virtual-ranks", "4", "--steps", str(steps)], 2, example=BN
    )
    dp = chain(workdir / "dp", BN, [*data, "--virtual-ranks", "4", "--data-parallel"], steps)
    result["dataparallel_rel_diff"] = rel_diff(dp, fixed)
    # Two epochs and a bit, through resizes, with DataLoader worker processes.
    loader = chain(workdir / "loader", BN, [*data, "--loader-workers", "2"], 16)
    try:
        check_exactly_once(loader, 200, 16, 7)
        result["dataloader_exactly_once"] = 1
    except AssertionError as exc:
        result["dataloader_exactly_once"] = 0
        result["dataloader_error"] = str(exc)
    result.update(contract(workdir / "contract", data, steps))
    # Throughput: a heavier batch so that compute, not Python, dominates a step.
    heavy = ["--dataset-size", "2048", "--global-batch", "128", "--width", "16", "--seed", "1"]
    heavy += ["--steps", str(30 if quick else 80)]
    plain = step_s(reference_run(workdir / "tp-plain", heavy, 2, example=BN))
    virtual = step_s(
        reference_run(workdir / "tp-virtual", [*heavy, "--virtual-ranks", "4"], 2, example=BN)
    )
    result["plain_step_s"] = round(plain, 4)
    result["virtual_step_s"] = round(virtual, 4)
    result["virtual_rank_throughput_ratio"] = round(plain / virtual, 3)
    result.update(crashloop.parity_keys(workdir / "crashloop"))
    result["wall_s"] = round(time.monotonic() - started, 1)
    for key in ("mlp", "batchnorm", "batchnorm_plain", "dataparallel", "augmentation"):
        result[f"{key}_rel_diff"] = float(f"{result[f'{key}_rel_diff']:.3g}")
    result["targets_met"] = (
        result["mlp_rel_diff"] <= 1e-5
        and result["batchnorm_rel_diff"] <= 1e-5
        and result["dataparallel_rel_diff"] <= 1e-5
        and result["dataloader_exactly_once"] == 1
        and result["augmentation_rel_diff"] <= 1e-5
        and result["loader_workers_deterministic"] == 1
        and result["forgotten_sampler_detected"] == 1
        and result["summed_loss_refused"] == 1
    )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--quick", action="store_true", help="short runs (about 3 minutes)")
    p.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
    args = p.parse_args(argv)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tide-parity-"))
    result = run(args.quick, workdir)
    print("RESULT " + json.dumps(result))
    return 0 if result["targets_met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
