"""The import-linter contracts (pyproject.toml) do catch a forbidden import.

`make lint` runs lint-imports on the tree; this test proves the contracts are not
vacuous: on a copy of the source tree it adds one forbidden import at a time and
expects lint-imports to fail naming the contract and the import, and to pass on
the copy without it. PYTHONPATH points at the copy, so the copy is what is
analysed (the editable install's finder comes after sys.path); the test checks
that too: the probe module it adds exists only in the copy, and a run with an
allowed probe sees the same number of files as a run with a forbidden one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support.procs import ROOT

pytestmark = pytest.mark.integration

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
CONTRACTS = {
    c["name"]: c
    for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
}
LAYERS = next(n for n in CONTRACTS if n.startswith("Layers:"))
NO_DOUBLES = next(n for n in CONTRACTS if "test doubles" in n)
TRAINER = next(n for n in CONTRACTS if n.startswith("The trainer never imports"))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of what lint-imports analyses: the packages, the generated API, the config."""
    copy = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("tide",):
        shutil.copytree(ROOT / name, copy / name, ignore=skip)
    shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
    return copy


def lint(tree: Path) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--no-logo"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return out.returncode, out.stdout + out.stderr


def analysed_files(report: str) -> int:
    m = re.search(r"Analyzed (\d+) files", report)
    assert m, report
    return int(m.group(1))


def broken(report: str) -> set[str]:
    """The contracts the report says are BROKEN (it wraps long names over lines)."""

    def pattern(name: str) -> str:
        return r"\s+".join(map(re.escape, name.split())) + r"\s+BROKEN"

    return {name for name in CONTRACTS if re.search(pattern(name), report)}


def test_the_copy_passes_and_an_agent_importing_the_scaler_breaks_the_layers(
    tree: Path,
) -> None:
    probe = tree / "tide" / "services" / "agent" / "layer_probe.py"
    probe.write_text("from tide.base import errors  # allowed: tide.base is below\n")
    code, clean = lint(tree)
    assert code == 0, clean
    assert not broken(clean), clean

    probe.write_text("import tide.services.scaler  # forbidden: the services are siblings\n")
    code, report = lint(tree)
    assert code != 0
    assert broken(report) == {LAYERS}, report
    assert "tide.services.agent.layer_probe -> tide.services.scaler" in report, report
    # The same files both times, the probe among them: the copy is what was analysed.
    assert analysed_files(clean) == analysed_files(report)


@pytest.mark.parametrize(
    ("path", "source", "contract", "named"),
    [
        (
            "tide/services/scaler/layer_probe.py",
            "import tide.services.testing\n",
            NO_DOUBLES,
            "tide.services.scaler.layer_probe -> tide.services.testing",
        ),
        (
            "tide/trainer/layer_probe.py",
            "import sqlalchemy\n",
            TRAINER,
            "tide.trainer.layer_probe -> sqlalchemy",
        ),
    ],
    ids=["production-imports-testing", "trainer-imports-sqlalchemy"],
)
def test_a_forbidden_import_fails_naming_the_contract(
    tree: Path, path: str, source: str, contract: str, named: str
) -> None:
    (tree / path).write_text(source)
    code, report = lint(tree)
    assert code != 0
    assert broken(report) == {contract}, report
    assert named in report, report
