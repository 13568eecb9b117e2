"""deploy/docker: what can be checked of the two images without a Docker engine. The
files each COPY names exist and pass the .dockerignore; the package built from exactly
those files holds every module the chart's containers and the trainer's entrypoint
run; the extras they install exist; the base images fit pyproject's Python and Paddle."""

from __future__ import annotations

import email.parser
import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.chart import EXAMPLES, ROOT, render

pytestmark = pytest.mark.component

DOCKER = ROOT / "deploy" / "docker"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str


def instructions(dockerfile: Path) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined and comments dropped."""
    out: list[Instruction] = []
    pending = ""
    for line in dockerfile.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        out.append(Instruction(keyword.upper(), args.strip()))
        pending = ""
    return out


def build_args(steps: list[Instruction]) -> dict[str, str]:
    return dict(s.args.split("=", 1) for s in steps if s.keyword == "ARG" and "=" in s.args)


def expand(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], text)


def copy_sources(steps: list[Instruction]) -> list[str]:
    """What the COPY instructions take from the build context (not from other stages)."""
    sources = []
    for s in steps:
        if s.keyword != "COPY" or "--from=" in s.args:
            continue
        *srcs, _dest = shlex.split(s.args)
        sources += [src.rstrip("/") for src in srcs if not src.startswith("--")]
    return sources


def ignored(path: str) -> bool:
    """Whether the root .dockerignore keeps ``path`` (or a folder above it) out of the context."""
    patterns = [
        p.strip()
        for p in (ROOT / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    # As Docker reads it: the last pattern that matches decides, `!` re-includes.
    kept_out = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        bare = pattern.removeprefix("!")
        if any(
            fnmatch.fnmatch(prefix, bare) or fnmatch.fnmatch(prefix, bare.removeprefix("**/"))
            for prefix in prefixes
        ):
            kept_out = not negated
    return kept_out


def wheel_of(sources: list[str], tmp_path: Path) -> zipfile.ZipFile:
    """The package built (PEP 517, setuptools) from the context files ``sources`` only."""
    context = tmp_path / "context"
    for src in sources:
        target = context / src
        if (ROOT / src).is_dir():
            shutil.copytree(
                ROOT / src,
                target,
                ignore=lambda folder, names: [
                    n for n in names if ignored(str((Path(folder) / n).relative_to(ROOT)))
                ],
            )
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / src, target)
    out = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setuptools import build_meta; build_meta.build_wheel({str(out)!r})",
        ],
        cwd=context,
        check=True,
        capture_output=True,
        timeout=120,
    )
    (whl,) = out.glob("*.whl")
    return zipfile.ZipFile(whl)


def metadata(whl: zipfile.ZipFile, name: str) -> str:
    (path,) = [n for n in whl.namelist() if n.endswith(f".dist-info/{name}")]
    return whl.read(path).decode()


def extras(whl: zipfile.ZipFile) -> list[str]:
    return email.parser.Parser().parsestr(metadata(whl, "METADATA")).get_all("Provides-Extra") or []


def installed_extras(steps: list[Instruction]) -> list[str]:
    return [
        m for s in steps if s.keyword == "RUN" for m in re.findall(r'"\.\[(\w[\w-]*)\]"', s.args)
    ]


def top_levels(whl: zipfile.ZipFile) -> set[str]:
    return {n.split("/", 1)[0] for n in whl.namelist() if ".dist-info/" not in n}


def test_the_wheel_ships_neither_the_benchmarks_nor_the_test_doubles(tmp_path: Path) -> None:
    """Built from a context that has bench/ and tide/services/testing/ (as `pip wheel .` from
    a checkout does): neither is installed into a user's image; what the services
    and the trainer run is (pyproject's packages.find)."""
    whl = wheel_of(
        ["pyproject.toml", "README.md", "tide", "bench"],
        tmp_path,
    )
    names = whl.namelist()
    assert top_levels(whl) == {"tide"}
    assert not [n for n in names if n.startswith(("bench/", "tide/services/testing/", "tests/"))]
    for module in (
        "tide.services.scaler",
        "tide.services.coordinator",
        "tide.services.cli",
        "tide.trainer.launch",
    ):
        assert has_module(whl, module), module


def has_module(whl: zipfile.ZipFile, module: str) -> bool:
    path = module.replace(".", "/")
    names = set(whl.namelist())
    return f"{path}/__main__.py" in names or f"{path}.py" in names


@pytest.mark.parametrize("name", ["services.Dockerfile", "trainer.Dockerfile"])
def test_what_each_image_copies_exists_and_is_in_the_context(name: str) -> None:
    sources = copy_sources(instructions(DOCKER / name))
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not ignored(src), f"{src} is excluded by .dockerignore"
    assert ignored(".venv/bin/python") and ignored("tide/services/__pycache__/x.pyc")


def test_the_services_image_runs_what_the_chart_runs(tmp_path: Path) -> None:
    steps = instructions(DOCKER / "services.Dockerfile")
    whl = wheel_of(copy_sources(steps), tmp_path)
    assert installed_extras(steps) == ["services"]
    assert "services" in extras(whl)
    # Without Paddle: no requirement of the services extra is Paddle's.
    requires = email.parser.Parser().parsestr(metadata(whl, "METADATA")).get_all("Requires-Dist")
    of_services = [r for r in requires or () if 'extra == "services"' in r]
    assert of_services and not [r for r in of_services if r.lower().startswith("paddle")]
    commands = {
        tuple(c["command"])
        for values in EXAMPLES.values()
        for w in render(values).workloads()
        for c in w["spec"]["template"]["spec"]["containers"]
    }
    assert len(commands) == 4  # scaler, coordinator, agent, `tide db upgrade`
    modules = []
    for command in commands:
        if command[:2] == ("python", "-m"):
            assert has_module(whl, command[2]), command
            modules.append(f"{command[2]}.__main__")
        else:
            assert command[0] == "tide"
            assert "tide = tide.services.cli.main:main" in metadata(whl, "entry_points.txt")
            modules.append("tide.services.cli.main")
    # They import without what the image leaves out.
    absent = ("tide.trainer", "numpy", "paddle", "matplotlib")
    code = f"import sys, importlib; sys.modules.update(dict.fromkeys({absent!r}))\n"
    code += "".join(f"importlib.import_module({m!r})\n" for m in sorted(modules))
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)
    # The store's migrations travel as package data.
    assert "tide/services/store/migrations/script.py.mako" in whl.namelist()
    assert any(n.startswith("tide/services/store/migrations/versions/0001") for n in whl.namelist())
    # The user the chart runs its pods as.
    (user,) = [s.args for s in steps if s.keyword == "USER"]
    assert user == "65532:65532"
    python = build_args(steps)["PYTHON_IMAGE"]
    assert _python_fits(re.search(r"python:(\d+\.\d+)", python).group(1))  # type: ignore[union-attr]


def _python_fits(version: str) -> bool:
    floor = PYPROJECT["project"]["requires-python"].removeprefix(">=")
    return tuple(map(int, version.split("."))) >= tuple(map(int, floor.split(".")))


def test_the_trainer_image_is_paddle_with_the_launcher(tmp_path: Path) -> None:
    steps = instructions(DOCKER / "trainer.Dockerfile")
    args = build_args(steps)
    # Two stages of one Python image: one interpreter, one Paddle (issue 32: the image
    # had a second Python and a second Paddle on top of Paddle's own).
    bases = [expand(s.args, args).split()[0] for s in steps if s.keyword == "FROM"]
    assert len(bases) == 2 and len(set(bases)) == 1, bases
    match = re.fullmatch(r"python:(\d+\.\d+)-slim-\w+", bases[0])
    assert match and _python_fits(match.group(1)), bases[0]
    runs = " ".join(s.args for s in steps if s.keyword == "RUN")
    assert runs.count("paddlepaddle") == 1 and "uv " not in runs
    # The Paddle release pyproject pins, GPU build from Paddle's CUDA index.
    (pin,) = [
        d
        for d in PYPROJECT["project"]["optional-dependencies"]["paddle-cpu"]
        if d.startswith("paddlepaddle")
    ]
    assert args["PADDLE_VERSION"].startswith(pin.removeprefix("paddlepaddle==").removesuffix("*"))
    assert re.search(r"/cu\d+/?$", args["PADDLE_INDEX"])
    # A venv made by `python -m venv` (it has pip), everything installed with the
    # constraints; the runtime stage runs as a non-root user that owns the venv, so a
    # training image's `RUN pip install` lands in the Python that runs.
    assert "python -m venv /opt/tide" in runs
    assert all(
        "-c constraints.txt" in s.args
        for s in steps
        if s.keyword == "RUN" and "pip install" in s.args
    )
    runtime = steps[max(i for i, s in enumerate(steps) if s.keyword == "FROM") :]
    (user,) = [s.args for s in runtime if s.keyword == "USER"]
    assert user not in ("root", "0")
    (venv,) = [s.args for s in runtime if s.keyword == "COPY" and "--from=build" in s.args]
    assert f"--chown={user}:{user}" in venv and "/opt/tide" in venv
    assert "PATH=/opt/tide/bin:$PATH" in " ".join(s.args for s in runtime if s.keyword == "ENV")

    (entrypoint,) = [json.loads(s.args) for s in steps if s.keyword == "ENTRYPOINT"]
    assert entrypoint == ["python", "-m", "tide.trainer.launch"]
    whl = wheel_of(copy_sources(steps), tmp_path)
    # The trainer and the base it stands on, nothing of the control plane.
    assert top_levels(whl) == {"tide"}
    assert not [n for n in whl.namelist() if n.startswith("tide/services/")]
    assert installed_extras(steps) == ["trainer"]
    assert "trainer" in extras(whl)
    assert has_module(whl, entrypoint[2])
    # The launcher's own command line: `--` and the training command after it.
    from tide.trainer.launch import parse_args

    with pytest.raises(SystemExit) as done:
        parse_args(["--help"])
    assert done.value.code == 0
    settings = parse_args(
        ["--coordinator", "c:1", "--job", "ns/job", "--", "python", "/app/train.py"]
    )
    assert settings.command == ("python", "/app/train.py")
