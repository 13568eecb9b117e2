"""PaddleFormers' Trainer under the session (the paddleformers extra; skipped without it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("paddleformers")

import numpy as np
import paddle

from tide.trainer.contract import UsageError
from tide.trainer.integrations import paddleformers as pf

pytestmark = [pytest.mark.integration, pytest.mark.paddle, pytest.mark.paddleformers]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "tide" / "trainer" / "integrations" / "examples"


class Stream(paddle.io.IterableDataset[dict[str, np.ndarray]]):
    def __iter__(self) -> Any:
        yield {"input_ids": np.zeros(4, np.int64), "labels": np.zeros(4, np.int64)}


class Items(paddle.io.Dataset[dict[str, np.ndarray]]):
    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": np.zeros(4, np.int64), "labels": np.zeros(4, np.int64)}

    def __len__(self) -> int:
        return 8


class OwnSampler(pf.Trainer):
    def _get_train_sampler(self) -> Any:
        return None


def _trainer(tmp_path: Path, dataset: Any, cls: Any = pf.Trainer, **args: Any) -> Any:
    kw: dict[str, Any] = {"max_grad_norm": 0.0, "amp_master_grad": False, "report_to": []}
    kw.update(args)
    targs = pf.TrainingArguments(output_dir=str(tmp_path), max_steps=2, **kw)
    return cls(model=paddle.nn.Linear(4, 4), args=targs, train_dataset=dataset)


def test_what_tide_cannot_keep_exact_is_refused_at_start_one_line_each(tmp_path: Path) -> None:
    assert pf.unsupported(_trainer(tmp_path, Items())) == []
    with pytest.raises(UsageError, match=r"train_dataset: Stream has no length"):
        _trainer(tmp_path, Stream()).train()
    [line] = pf.unsupported(_trainer(tmp_path, Items(), OwnSampler))
    assert line.startswith("OwnSampler._get_train_sampler: overridden")
    [line] = pf.unsupported(_trainer(tmp_path, Items(), max_grad_norm=1.0))
    assert line.startswith("TrainingArguments.max_grad_norm")
    with pytest.raises(UsageError, match="resume_from_checkpoint='ckpt/checkpoint-5'"):
        _trainer(tmp_path, Items()).train(resume_from_checkpoint="ckpt/checkpoint-5")


@pytest.mark.parametrize("script", ["train_pf_stock.py", "train_pf_tide.py"])
def test_the_stock_script_and_its_tide_twin_train(script: str, tmp_path: Path) -> None:
    """Alone (a world of 1): the stock one in PaddleFormers' loop, the twin in the session's,
    which logs every step and checkpoints at save_steps."""
    logs = tmp_path / "logs"
    cmd = [sys.executable, str(EXAMPLES / script), "--steps", "6", "--ckpt-dir", str(tmp_path)]
    out = subprocess.run(
        [*cmd, "--log-dir", str(logs)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    if script == "train_pf_tide.py":
        steps = [json.loads(line)["step"] for line in (logs / "loss.jsonl").open()]
        assert steps == [1, 2, 3, 4, 5, 6]
        assert sorted(p.name for p in (tmp_path / "tide").glob("step-*")) == [
            "step-00000005",
            "step-00000006",
        ]
