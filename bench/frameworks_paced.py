"""tide/trainer/integrations/examples/train_pf_tide.py paced for live resizes (bench/frameworks.py).

Each micro-batch first sleeps ``TIDE_BENCH_STEP_DELAY_S`` seconds, so that the benchmark's
resizes land mid-run however fast the tiny model trains. A harness, not a user script: the
example itself runs unchanged.
"""

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from tide.trainer.integrations import paddleformers as pf

SCRIPT = str(
    Path(__file__).resolve().parent.parent / "tide/trainer/integrations/examples/train_pf_tide.py"
)
_DELAY_S = float(os.environ.get("TIDE_BENCH_STEP_DELAY_S", "0"))
_loss = pf.Trainer.per_sample_loss


def _paced(model: Any, batch: Any) -> Any:
    time.sleep(_DELAY_S)
    return _loss(model, batch)


if __name__ == "__main__":
    pf.Trainer.per_sample_loss = staticmethod(_paced)  # type: ignore[method-assign]
    sys.argv[0] = SCRIPT
    runpy.run_path(SCRIPT, run_name="__main__")
