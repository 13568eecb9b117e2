"""docs/migrate.md cannot rot: its diffs are those between scripts these tests run, its
launch command translates, and its table is the launcher's own.

``python -m tests.trainer.test_migrate_docs --write`` rewrites the generated parts.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from bench.frameworks import script_diff
from tide.trainer.integrations import paddle_launch as pl

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "migrate.md"
EXAMPLES = ROOT / "tide" / "trainer" / "integrations" / "examples"
DIFF = re.compile(r"<!-- diff: (\S+) (\S+) -->\n```diff\n(.*?)```\n", re.S)
TABLE = re.compile(r"(<!-- launch-table -->\n)(.*?)(<!-- /launch-table -->\n)", re.S)
LAUNCH = re.compile(r"<!-- launch -->\n```diff\n-(.*?)\n\+(.*?)\n```", re.S)


def table() -> str:
    rows = [f"| `{k}` | {v} |" for k, v in pl.ACCEPTED.items()]
    rows += [f"| `{k}` | refused: {v} |" for k, v in pl.REFUSED.items()]
    head = "| `paddle.distributed.launch` | under `tide.trainer.launch` |\n| --- | --- |\n"
    return head + "\n".join(rows) + "\n"


def generated(text: str) -> str:
    def diff(m: re.Match[str]) -> str:
        body = "\n".join(script_diff(ROOT / m[1], ROOT / m[2]))
        return f"<!-- diff: {m[1]} {m[2]} -->\n```diff\n{body}\n```\n"

    text = DIFF.sub(diff, text)
    return TABLE.sub(lambda m: m[1] + table() + m[3], text)


@pytest.mark.unit
def test_the_guide_is_generated_from_the_scripts_and_the_launcher() -> None:
    text = GUIDE.read_text()
    assert len(DIFF.findall(text)) == 2
    assert text == generated(text), "run: python -m tests.trainer.test_migrate_docs --write"


@pytest.mark.unit
def test_the_guides_launch_command_is_paddles_with_the_module_swapped() -> None:
    m = LAUNCH.search(GUIDE.read_text())
    assert m is not None
    paddle_cmd, tide_cmd = shlex.split(m[1]), shlex.split(m[2])
    assert paddle_cmd[:3] == ["python", "-m", "paddle.distributed.launch"]
    assert tide_cmd == ["python", "-m", "tide.trainer.launch", *paddle_cmd[3:]]
    t = pl.translate(tide_cmd[3:], {})
    assert (t.min_replicas, t.max_replicas) == (2, 4)


@pytest.mark.integration
@pytest.mark.paddle
@pytest.mark.parametrize("script", ["train_dp_stock.py", "train_dp_tide.py"])
def test_both_dataparallel_scripts_of_the_guide_train(script: str, tmp_path: Path) -> None:
    """Alone (a world of 1): the stock one as Paddle runs it, the other as the session does."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--epochs", "1", "--ckpt-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        GUIDE.write_text(generated(GUIDE.read_text()))
    else:
        raise SystemExit("usage: python -m tests.trainer.test_migrate_docs --write")
