"""`python -m tide.trainer.launch` with `paddle.distributed.launch`'s arguments."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tide.base.errors import ConfigError
from tide.trainer import launch
from tide.trainer.integrations import paddle_launch as pl

pytestmark = pytest.mark.unit

ENV = {"POD_NAMESPACE": "ml"}


def test_a_paddle_command_line_becomes_tides() -> None:
    argv = ["--nnodes", "2:4", "--nproc_per_node", "2", "--log_dir", "logs", "--job_id", "gpt"]
    argv += ["--master", "10.0.0.1:7000", "--rank", "1", "--gpus", "0,1", "--run_mode=collective"]
    t = pl.translate([*argv, "train.py", "--lr", "3e-4", "--", "x"], ENV)
    assert (t.min_replicas, t.max_replicas) == (2, 4)
    assert t.env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    cut = t.argv.index("--")
    assert t.argv[:cut] == (
        "--workers-per-pod", "2", "--state-dir", "logs", "--job", "ml/gpt",
        "--coordinator", "10.0.0.1:7000", "--pod-index", "1",
    )  # fmt: skip
    assert t.argv[cut + 1 :] == (sys.executable, "train.py", "--lr", "3e-4", "--", "x")
    s = launch.parse_args(list(t.argv))
    assert (s.workers_per_pod, s.job_id, s.pod_index, s.state_dir) == (2, "ml/gpt", 1, "logs")


def test_tide_flags_mix_in_and_the_native_form_is_left_alone() -> None:
    t = pl.translate(["--coordinator", "h:1", "--no-zygote", "--nnodes=3", "t.py"], ENV)
    assert t.argv[:3] == ("--coordinator", "h:1", "--no-zygote")
    assert (t.min_replicas, t.max_replicas) == (3, 3)
    assert not pl.is_paddle_style(["--coordinator", "h:1", "--", "python", "t.py"])
    assert pl.is_paddle_style(["t.py"])
    assert pl.is_paddle_style(["--nnodes", "2", "t.py", "--", "x"])  # the script's own "--"


def test_every_argument_tide_cannot_honour_is_refused_with_a_line_each(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--coordinator", "h:1", "--job", "a/b", "--ips", "a,b", "--max_restart", "3"]
    assert launch.main([*argv, "--run_mode", "ps", "train.py"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"error: --ips: {pl.REFUSED['--ips']}",
        f"error: --max_restart: {pl.REFUSED['--max_restart']}",
        "error: --run_mode ps: Tide trains collectively only",
    ]


@pytest.mark.parametrize("bad", ["0", "4:2", "two", "1:x"])
def test_nnodes_is_checked(bad: str) -> None:
    with pytest.raises(ConfigError, match="--nnodes"):
        pl.translate(["--nnodes", bad, "t.py"], ENV)


def test_print_job_gives_the_bounds_to_tide_job_apply(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--master", "h:1", "--job_id", "gpt", "--nnodes", "2:4", "--print-job", "t.py"]
    assert launch.main(argv) == 0
    out = capsys.readouterr().out
    assert out == (
        "job_id: default/gpt\ninitial_replicas: 2\npolicy:\n  min_replicas: 2\n  max_replicas: 4\n"
    )


def test_every_paddle_launch_argument_is_either_accepted_or_refused() -> None:
    """The tables cover Paddle's own parser: a flag added upstream fails this test."""
    pytest.importorskip("paddle")
    from paddle.distributed.launch.context import args_envs

    # parse_args builds its parser inside the function: read the flags from its source.
    src = Path(args_envs.__file__).read_text()
    flags = set(re.findall(r'"(--[a-z_]+)"', src))
    assert flags == set(pl.ACCEPTED) | set(pl.REFUSED)
    assert not set(pl.ACCEPTED) & set(pl.REFUSED)
