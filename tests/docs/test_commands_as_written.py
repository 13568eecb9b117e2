"""Every command in README.md and docs/ works as written on a fresh clone.

tests/docs/commands.py finds the commands (fenced shell blocks and inline code
spans); each simple command then gets the strongest check that fits it, and a
command no rule covers fails the test, so a new documented command must be
handled here:

- RUN: cheap commands run end to end from a scratch directory that mirrors the
  checkout (seconds each), exit 0, no WARNING and no traceback.
- parsed: ``tide ...``, ``python -m MODULE ...`` and ``python FILE ...`` of this
  repository are parsed by the program's own parser without running it
  (tests/docs/parsing.py); placeholders (JOB, N, URL) get a value of their type.
- options: a synopsis (``[--opt]``, ``a|b``, ``…``) names only options, and choices,
  its command takes.
- offline: a read command of ``tide`` (jobs, history, explain, chart, whatif)
  parsed, then run in process against an empty SQLite store: the times, states
  and formats its body checks must pass, "not found" is the expected answer.
- pod-files: a service line that passes its parse and settings checks but names
  absolute paths that exist on its target machine only (the chart's certificate
  files), which a start here refuses.
- reference: an inline span that names a command and options without their
  values (``tide scale --wait``): the names must exist.
- make targets exist in the Makefile; pytest paths exist and markers are declared;
  a ``python -c`` snippet compiles; other programs (kubectl, helm, psql, ...) need
  a cluster or a server, so only the repository files they name must exist, and
  the extras ``pip`` installs must be declared.

ALLOWED names commands that are illustrative on purpose, with the reason;
PENDING names broken commands in docs another change owns, with the fix due.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path

import pytest

from tests.docs.commands import (
    ROOT,
    Command,
    Simple,
    all_commands,
    extract,
    is_synopsis,
    split_line,
    synopsis_words,
)

# About 10 s of CPU in all; on a shared 2-core machine the wall time is mostly
# waiting for it, hence more than the default 120 s before a timeout.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(360)]

# Run end to end, exactly as written (each a second or two), in a scratch checkout
# and a scratch HOME; the commands of a group in order, the groups side by side.
RUN = (
    ("tide --version",),
    ("python -m tide.services.cli --version",),
    ("python -m tide.services.scaler --help",),
    ("tide simulate scenarios/busy_idle.yaml --set tide.policy.signal=sm_active",),
    (  # docs/cli.md's contexts, as a new user types them
        "tide config set-context prod --scaler 127.0.0.1:50051 --tls-ca-file tide-ca.crt"
        " --token-file ~/.tide-token --tls-server-name tide-scaler",
        "tide config use-context prod",
        "tide config get-contexts",
    ),
)
RUN_WORDS = frozenset(w for group in RUN for w in group)

# (file, command as written) -> why it is not checked.
ALLOWED: dict[tuple[str, str], str] = {
    ("README.md", "python -m tide.services.<name>"): "names the three services, each checked below",
    ("docs/migrate.md", "python train.py"): "the user's own training script",
    ("docs/sharded.md", "python -m tide.trainer.launch ... -- python train.py ..."): (
        "the shape of a launcher line around the user's script"
    ),
}

# Broken commands in docs owned by another change this session: (file, command) -> fix.
PENDING: dict[tuple[str, str], str] = {}

REPO_DIRS = frozenset({"bench", "deploy", "docs", "scenarios", "scripts", "tests", "tide"})
EXTERNAL = frozenset(
    {"kubectl", "helm", "docker", "psql", "sqlite3", "grpcurl", "promtool", "git", "jq"}
    | {"openssl", "base64", "curl", "alembic", "pip", "bash", "sh"}
)


@dataclass
class Outcome:
    cmd: Command
    words: str
    how: str  # run, parsed, options, reference, module, make, pytest, ...
    problem: str = ""


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*)\s*:", text, re.M))


def _markers() -> set[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {m.split(":")[0] for m in cfg["tool"]["pytest"]["ini_options"]["markers"]}


def _extras() -> set[str]:
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(cfg["project"]["optional-dependencies"])


def _repo_paths(words: list[str]) -> list[str]:
    """Words that name a file of this repository (deploy/..., docs/...)."""
    out = []
    for w in words:
        w = w.split("=", 1)[-1]
        if "/" in w and w.split("/", 1)[0] in REPO_DIRS and "$" not in w:
            out.append(w)
    return out


def _missing(paths: list[str]) -> str:
    gone = [p for p in paths if not list(ROOT.glob(p.split("::")[0].rstrip("/")))]
    return f"no such file: {', '.join(gone)}" if gone else ""


def _test_files(path: Path) -> list[Path]:
    return sorted(path.rglob("test_*.py")) if path.is_dir() else [path] if path.exists() else []


def _module_source(module: str) -> Path | None:
    spec = find_spec(module)
    if spec is None or spec.origin is None:
        return None
    origin = Path(spec.origin)
    if spec.submodule_search_locations is not None:
        origin = origin.parent / "__main__.py"
    return origin if origin.exists() else None


class Checker:
    """Classifies each simple command; argument parsing is batched into one process."""

    def __init__(self) -> None:
        self.targets = _make_targets()
        self.markers = _markers()
        self.extras = _extras()
        self.outcomes: list[Outcome] = []
        self.requests: list[tuple[Outcome, dict[str, object]]] = []

    def add(self, cmd: Command, s: Simple) -> None:
        o = Outcome(cmd, " ".join(s.argv), "")
        self.outcomes.append(o)
        o.how, o.problem = self._classify(o, s)

    def _parse(self, o: Outcome, s: Simple, kind: str, target: str, words: list[str]) -> str:
        syn = is_synopsis(words)
        request = {
            "id": len(self.requests),
            "kind": kind,
            "target": target,
            "words": synopsis_words(words) if syn else words,
            "mode": "options" if syn else "full",
            "env": s.env,
        }
        self.requests.append((o, request))
        return "options" if syn else "parsed"

    def _classify(self, o: Outcome, s: Simple) -> tuple[str, str]:
        prog, args = s.program, s.argv[1:]
        if not s.argv or prog in ("export", "cd"):
            return "shell", ""
        if prog in ("tide", ".venv/bin/tide"):
            return self._parse(o, s, "tide", "tide", args), ""
        if prog in ("python", "python3", ".venv/bin/python") and args[:2] == [
            "-m",
            "tide.services.cli",
        ]:
            return self._parse(o, s, "tide", "tide", args[2:]), ""
        if prog in ("python", "python3", ".venv/bin/python"):
            return self._python(o, s, args)
        if prog in ("pytest", ".venv/bin/pytest"):
            return self._pytest(args)
        if prog == "make":
            wrong = [a for a in args if not a.startswith("-") and a not in self.targets]
            return "make", f"no such make target: {', '.join(wrong)}" if wrong else ""
        if prog == "xargs":
            rest = list(args)
            while rest and rest[0].startswith("-"):
                flag = rest.pop(0)
                if flag in ("-I", "-n", "-P", "-d"):
                    rest.pop(0)
            return self._classify(o, Simple(s.env, rest)) if rest else ("shell", "")
        if prog in EXTERNAL:
            if prog == "kubectl":  # deploy/NAME is a Deployment there: only -f and -k name files
                args = [v for f, v in itertools.pairwise(args) if f in ("-f", "-k")]
            problem = _missing(_repo_paths(args) + [p for p in s.inputs if "/" in p])
            if prog == "pip":
                for m in re.finditer(r"\[([\w,-]+)\]", " ".join(args)):
                    unknown = set(m.group(1).split(",")) - self.extras
                    if unknown:
                        problem += f"no such extra: {', '.join(sorted(unknown))}"
            return "external", problem
        return "unclassified", f"no rule for the program {prog!r}: add one to this test"

    def _python(self, o: Outcome, s: Simple, args: list[str]) -> tuple[str, str]:
        if args[:1] == ["-c"] and len(args) > 1:
            try:
                compile(args[1], "<doc>", "exec")
            except SyntaxError as e:
                return "compiles", f"python -c does not compile: {e}"
            return "compiles", ""
        if args[:1] == ["-m"] and len(args) > 1:
            module, words = args[1], args[2:]
            if module == "pytest":
                return self._pytest(words)
            if not re.fullmatch(r"[\w.]+", module):
                return "module", f"not a module name: {module}"
            if module.split(".")[0] not in REPO_DIRS:
                ok = find_spec(module.split(".")[0]) is not None
                return "module", "" if ok else f"no module {module} in the venv"
            source = _module_source(module)
            if source is None:
                return "module", f"no module {module}"
            text = source.read_text()
            if any(k in text for k in ("argparse", "load_settings", "parse_args", "run_service")):
                return self._parse(o, s, "module", module, words), ""
            # No parser: the options it takes are compared as literals.
            unknown = [w for w in words if w.startswith("-") and w not in text]
            return "module", f"{module} does not read {', '.join(unknown)}" if unknown else ""
        if args and args[0].endswith(".py"):
            path = ROOT / args[0]
            if not path.exists():
                return "file", f"no such file: {args[0]}"
            return self._parse(o, s, "file", str(path), args[1:]), ""
        return "unclassified", "python without -m, -c or a script"

    def _pytest(self, args: list[str]) -> tuple[str, str]:
        problems = []
        keywords: set[str] = set()
        paths: list[str] = []
        it = iter(args)
        for a in it:
            if a == "-m":
                expr = next(it, "")
                words = set(re.findall(r"[A-Za-z_]\w*", expr)) - {"and", "or", "not"}
                if words - self.markers:
                    problems.append(f"no such marker: {', '.join(sorted(words - self.markers))}")
            elif a == "-k":
                keywords |= set(re.findall(r"[A-Za-z_]\w*", next(it, ""))) - {"and", "or", "not"}
            elif not a.startswith("-"):
                problems.append(_missing([a]))
                paths.append(a.split("::")[0])
        # -k WORD must name a test of the files given (without collecting them).
        files = [f for p in paths for f in _test_files(ROOT / p)]
        names = " ".join(re.findall(r"def (test_\w+)", " ".join(f.read_text() for f in files)))
        unknown = sorted(k for k in keywords if files and k not in names)
        if unknown:
            problems.append(f"-k selects no test of {', '.join(paths)}: {', '.join(unknown)}")
        return "pytest", "; ".join(p for p in problems if p)

    def run_parsers(self, tmp: Path) -> None:
        if not self.requests:
            return
        src, dst = tmp / "requests.json", tmp / "results.json"
        src.write_text(json.dumps([r for _, r in self.requests]))
        r = subprocess.run(
            [sys.executable, "-m", "tests.docs.parsing", str(src), str(dst), str(tmp / "e.db")],
            cwd=ROOT,
            env={k: v for k, v in os.environ.items() if not k.startswith("TIDE_")},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        results = json.loads(dst.read_text())
        for o, request in self.requests:
            problem, ran = results[str(request["id"])]
            bare = not request["words"] and problem.startswith("exits 2 at start")
            if o.cmd.inline and (problem.startswith("incomplete:") or bare):
                # `tide scale --wait` or `python -m tide.services.scaler` in prose names a
                # command (and an option), not a line to run as it is.
                o.how, problem = "reference", ""
            elif ran:
                o.how = "offline"
            absent = re.search(r"no such file '(/[^']+)'", problem)
            if absent and absent.group(1) in request["words"]:  # type: ignore[operator]
                # A production line naming its pod's files (/var/run/tide/tls/tls.crt):
                # everything up to that file's check passed.
                o.how, problem = "pod-files", ""
            o.problem = problem


def check(commands: list[Command], tmp: Path) -> list[Outcome]:
    checker = Checker()
    for cmd in commands:
        if (cmd.file, cmd.text) in ALLOWED or (cmd.file, cmd.text) in PENDING:
            continue
        try:
            simples = split_line(cmd)
        except ValueError as e:
            checker.outcomes.append(Outcome(cmd, cmd.text, "unparsable", f"shell words: {e}"))
            continue
        for s in simples:
            checker.add(cmd, s)
    checker.run_parsers(tmp)
    for o in checker.outcomes:
        if o.how == "parsed" and o.words in RUN_WORDS:
            o.how = "run"
    return checker.outcomes


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> list[Outcome]:
    return check(all_commands(), tmp_path_factory.mktemp("parse"))


def _table(outcomes: list[Outcome]) -> str:
    return "\n".join(f"{o.how:10} {o.cmd.where:36} {o.words}" for o in outcomes)


def test_every_documented_command_works_as_written(checked: list[Outcome]) -> None:
    print("\n" + _table(checked))  # which commands are run, parsed, only referenced
    failures = [f"{o.cmd.where}: `{o.cmd.text}`: {o.problem}" for o in checked if o.problem]
    assert not failures, "documented commands that fail as written:\n" + "\n".join(failures)


WRONG = {
    "tide job get": "No such command 'get'",
    "tide --token-file t jobs": "No such option: --token-file",  # the token is an option of each command
    "tide scale ml/resnet --replicas two --reason x": "replicas",
    "tide history JOB --limit": "incomplete",  # a block command must be complete
    "tide config": "incomplete: a group of commands",
    "tide history JOB --since yesterday": "against an empty store it exits 2",
    "python -m bench.k8s --quick --insecure": "unrecognized arguments: --insecure",
    "python -m tide.trainer.launch --backend auto|mpi": "not a choice: mpi",
    "python -m bench.nosuch --quick": "no module bench.nosuch",
    "python -m tide.services.coordinator --listen 127.0.0.1:0": "exits 2 at start: coordinator: no TLS",
    "python -m tide.services.agent --insecure --interval-s soon": "interval_s",
    "python scripts/nosuch.py": "no such file",
    "make no-such-target": "no such make target",
    "pytest tests/nosuch.py -m notamarker": "no such marker: notamarker",
    "pytest tests/scaler/test_sharded.py -k frobnicate": "-k selects no test",
    "helm install tide deploy/helm/nosuch": "no such file",
    "pip install .[nosuch]": "no such extra: nosuch",
    "frobnicate --all": "no rule for the program",
}
RIGHT = (
    "tide history JOB --all",
    "tide history ml/resnet --since 24h --state ABORTED,FAILED --db URL",
    "TIDE_INSECURE=1 python -m bench.k8s --quick --workdir /tmp/x",
    "tide scale NS/NAME --replicas N --reason x",
    "python -m tide.trainer.launch --backend auto|nccl|gloo --workers-per-pod N",
    "tide jobs -o json | jq -r .jobs | xargs -I{} tide pause {} --reason freeze",
    "kubectl -n tide-system exec deploy/tide-scaler -- tide jobs",
)


def test_the_checks_catch_what_is_wrong_and_pass_what_is_right(tmp_path: Path) -> None:
    """The checker itself: each wrong command is caught for its reason, placeholders,
    environment prefixes, synopses and pipelines of right ones pass."""
    cmds = [Command("x.md", i, t, inline=False) for i, t in enumerate([*WRONG, *RIGHT])]
    by_text: dict[str, list[str]] = {}
    for o in check(cmds, tmp_path):
        by_text.setdefault(o.cmd.text, []).append(o.problem)
    for text, why in WRONG.items():
        assert any(why in p for p in by_text[text]), (text, by_text[text])
    for text in RIGHT:
        assert not any(by_text[text]), (text, by_text[text])


def test_extraction_reads_blocks_and_spans_as_a_shell_would(tmp_path: Path) -> None:
    doc = tmp_path / "docs" / "x.md"
    doc.parent.mkdir()
    doc.write_text(
        "Run `tide history JOB --all`, not `tide` or `tide.v1` or `tide = a:b`.\n"
        "`tide demo --insecure` <!-- not-a-command -->\n"
        "\n"
        "```bash\n"
        "# a comment\n"
        "TIDE_INSECURE=1 python -m bench.k8s \\\n"
        "    --quick   # one loop\n"
        "tide jobs -o json | jq -r '.jobs[] | .job_id' && make demo\n"
        "```\n"
        "```\n"
        " scaler ──▶ coordinator\n"
        "$ tide jobs\n"
        "JOB  REPLICAS\n"
        "```\n"
        "<!-- not-a-command -->\n"
        "```sh\n"
        "tide explode\n"
        "```\n"
    )
    cmds = extract(doc, tmp_path)
    assert [(c.line, c.text) for c in cmds] == [
        (1, "tide history JOB --all"),
        (6, "TIDE_INSECURE=1 python -m bench.k8s --quick   # one loop"),
        (8, "tide jobs -o json | jq -r '.jobs[] | .job_id' && make demo"),
        (12, "tide jobs"),
    ]
    first, pipeline = split_line(cmds[1]), split_line(cmds[2])
    assert first[0].env == {"TIDE_INSECURE": "1"}
    assert first[0].argv == ["python", "-m", "bench.k8s", "--quick"]
    assert [s.argv for s in pipeline] == [
        ["tide", "jobs", "-o", "json"],
        ["jq", "-r", ".jobs[] | .job_id"],
        ["make", "demo"],
    ]


def test_the_allow_lists_name_commands_that_are_still_written() -> None:
    written = {(c.file, c.text) for c in all_commands()}
    stale = [k for k in (*ALLOWED, *PENDING) if k not in written]
    assert not stale, f"allow-list entries whose command is no longer in the docs: {stale}"


@pytest.fixture(scope="module")
def mirror(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A scratch directory that looks like the checkout, so what a command writes
    (charts, out/, .tide/) lands outside it."""
    d = tmp_path_factory.mktemp("checkout")
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".tide", "out"):
            (d / entry.name).symlink_to(entry)
    yield d


def _run_group(group: tuple[str, ...], cwd: Path, env: dict[str, str]) -> str:
    written = {" ".join(s.argv): (c, s) for c in all_commands() for s in split_line(c)}
    for words in group:
        cmd, simple = written[words]
        r = subprocess.run(
            simple.argv,
            cwd=cwd,
            env={**env, **simple.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )
        logged = re.search(r"^\S+ (WARNING|ERROR) ", r.stdout, re.M) or "Traceback" in r.stdout
        if r.returncode != 0 or logged:
            return f"`{words}` ({cmd.where}) exit {r.returncode}:\n{r.stdout[-1500:]}"
    return ""


def test_the_cheap_commands_run_as_written(mirror: Path, tmp_path: Path) -> None:
    written = {" ".join(s.argv) for c in all_commands() for s in split_line(c)}
    missing = [words for words in RUN_WORDS if words not in written]
    assert not missing, f"RUN names commands the docs no longer hold: {missing}"
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["HOME"] = str(tmp_path)
    for name in [k for k in env if k.startswith("TIDE_")]:
        del env[name]  # as a fresh shell has it
    with ThreadPoolExecutor(len(RUN)) as pool:
        failures = [f for f in pool.map(lambda g: _run_group(g, mirror, env), RUN) if f]
    assert not failures, "\n".join(failures)
