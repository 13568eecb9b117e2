"""deploy/compat: the one-release alias of the launcher's old module path. It ships
`trainer/launch.py` alone (no top-level package of its own that could shadow a
user's), `python -m trainer.launch` warns that the launcher moved and runs it, and
the trainer image installs it (docs/packaging.md)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.component

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "deploy" / "compat"


def test_the_compat_wheel_holds_trainer_launch_only(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta; build_meta.build_wheel({str(tmp_path)!r})",
        ],
        cwd=COMPAT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (whl,) = tmp_path.glob("*.whl")
    names = [n for n in zipfile.ZipFile(whl).namelist() if ".dist-info/" not in n]
    assert names == ["trainer/launch.py"]


def test_python_m_trainer_launch_warns_and_runs_the_launcher(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(COMPAT), str(ROOT)])}
    out = subprocess.run(
        [sys.executable, "-m", "trainer.launch", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "moved to `python -m tide.trainer.launch`" in out.stderr
    # The launcher's own help, not the alias's.
    assert "--coordinator" in out.stdout


def test_the_trainer_image_installs_the_alias() -> None:
    dockerfile = (ROOT / "deploy" / "docker" / "trainer.Dockerfile").read_text()
    # The install line runs on (continuation lines): one logical RUN names both.
    runs = [r.split("\n", 1)[0] for r in dockerfile.replace("\\\n", " ").split("\nRUN ")[1:]]
    assert any("pip install" in r and "./deploy/compat" in r for r in runs), runs
