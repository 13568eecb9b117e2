"""Parse a documented command's arguments with the program's own parser, without
running the program.

Run as ``python -m tests.docs.parsing IN.json OUT.json EMPTY.db`` in a process of its own:
every check imports the program's module as ``__main__`` (argparse modules build
their parser inside ``main``), which must not leave its environment, logging or
imports behind in the test process.

- ``tide ...`` (typer, i.e. click): the command tree is walked with click's own
  ``make_context`` and ``resolve_command``: options, arguments and their types are
  converted exactly as a real run would, and nothing is invoked.
- ``python -m MODULE`` / ``python FILE``: the module runs as ``__main__`` with
  ``argparse.ArgumentParser.parse_args`` and ``parse_known_args`` replaced: the
  outermost call parses for real, then raises instead of returning, so the
  program stops at the point where its arguments were accepted; a parse error
  is reported instead of exiting. A service (settings from
  tide/services/common/config.py) goes further, as far as a real start does before it
  configures its logs: its values converted, its settings and its security
  checked, so a line that would exit 2 ("no TLS: ...") fails here too.

A ``tide`` read command that can read the store offline (jobs, history,
explain, chart, whatif) then runs for real, in process, against an empty
SQLite store (EMPTY.db): the values the parser leaves to the command (times,
states, output formats) must pass; "not found" is the expected answer.

A request's ``mode`` is ``full`` (the words must parse as they are, placeholders
given a value) or ``options`` (a synopsis: every option it names must be one the
parser takes, and a choice list ``a|b`` must name valid choices).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
import time
from collections.abc import Iterator
from typing import Any

import typer
from typer import _click as click  # typer vendors the part of click it uses
from typer.core import TyperGroup

from tide.services.common import config as settings_config
from tide.services.common import logs as service_logs

# A placeholder gets a value of the type its position needs.
VALUES = {
    "JOB": "ns/job",
    "NS/NAME": "ns/job",
    "BUSY": "ns/job",
    "{}": "ns/job",
    "N": "1",
    "I": "1",
    "M": "1",
    "S": "1",
    "ID": "1",
    "DECISION_ID": "1",
    "<id>": "1",
    "URL": "sqlite:///tide.db",
    "HOST:PORT": "127.0.0.1:50051",
}


class _Parsed(BaseException):
    def __init__(self, parser: argparse.ArgumentParser | None) -> None:
        self.parser = parser


class _ParseError(BaseException):
    def __init__(self, message: str) -> None:
        self.message = message


def substitute(words: list[str]) -> list[str]:
    return [VALUES.get(w, w) for w in words]


# ---------------------------------------------------------------- argparse


@contextlib.contextmanager
def _argparse_stops(mode: str) -> Iterator[None]:
    """While active, the first parse of the process raises _Parsed (after parsing for
    real in ``full`` mode, before in ``options`` mode) and errors raise _ParseError."""
    orig_pa = argparse.ArgumentParser.parse_args
    orig_pka = argparse.ArgumentParser.parse_known_args
    orig_error = argparse.ArgumentParser.error
    orig_exit = argparse.ArgumentParser.exit
    orig_build, orig_configure = settings_config.build_parser, service_logs.configure
    depth = [0]
    settings_parsed = [False]

    def outermost(fn: Any) -> Any:
        def wrapper(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
            if mode == "options" and depth[0] == 0:
                raise _Parsed(self)
            if getattr(self, "tide_settings", False):
                # A service: its values are converted and its security checked after
                # the parse; it stops where it would configure its logs and start.
                out = fn(self, *a, **k)
                settings_parsed[0] = True
                return out
            depth[0] += 1
            try:
                out = fn(self, *a, **k)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                raise _Parsed(self)
            return out

        return wrapper

    def error(self: argparse.ArgumentParser, message: str) -> Any:
        raise _ParseError(message)

    def exit(self: argparse.ArgumentParser, status: int = 0, message: str | None = None) -> Any:
        # --help and --version exit 0 from inside the parse: accepted.
        if status == 0:
            raise _Parsed(self)
        raise _ParseError(message or f"exit {status}")

    def build_parser(*a: Any, **k: Any) -> argparse.ArgumentParser:
        parser = orig_build(*a, **k)
        parser.tide_settings = True  # type: ignore[attr-defined]
        return parser

    def configure(*a: Any, **k: Any) -> None:
        if settings_parsed[0]:
            raise _Parsed(None)
        orig_configure(*a, **k)

    settings_config.build_parser = build_parser
    service_logs.configure = configure
    argparse.ArgumentParser.parse_args = outermost(orig_pa)  # type: ignore[method-assign]
    argparse.ArgumentParser.parse_known_args = outermost(orig_pka)  # type: ignore[method-assign]
    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    argparse.ArgumentParser.exit = exit  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = orig_pa  # type: ignore[method-assign]
        argparse.ArgumentParser.parse_known_args = orig_pka  # type: ignore[method-assign]
        argparse.ArgumentParser.error = orig_error  # type: ignore[method-assign]
        argparse.ArgumentParser.exit = orig_exit  # type: ignore[method-assign]
        settings_config.build_parser, service_logs.configure = orig_build, orig_configure


def check_argparse(target: str, is_file: bool, words: list[str], mode: str) -> str:
    """'' when the program's parser accepts ``words``, else why not."""
    argv = substitute(words) if mode == "full" else words
    sys.argv = [target, *argv]
    out = io.StringIO()
    try:
        with (
            _argparse_stops(mode),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(out),
        ):
            if is_file:
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except _Parsed as p:
        if mode == "options" and p.parser is not None:
            return _argparse_options(p.parser, words)
        return ""
    except _ParseError as e:
        if "required" in e.message or "expected one argument" in e.message:
            return f"incomplete: {e.message}"
        return f"its parser refuses it: {e.message}"
    except SystemExit as e:
        return f"exits {e.code} at start: {out.getvalue().strip()[-300:]}"
    except Exception as e:  # reported; the next check goes on
        return f"failed before parsing its arguments: {type(e).__name__}: {e}"
    return "ran to the end without parsing its arguments with argparse"


def _argparse_options(parser: argparse.ArgumentParser, words: list[str]) -> str:
    known = parser._option_string_actions  # argparse keeps them only here
    cut = words.index("--") if "--" in words else len(words)
    bad = []
    for i, w in enumerate(words[:cut]):
        if not w.startswith("-") or w == "-":
            continue
        name = w.split("=", 1)[0]
        action = known.get(name)
        if action is None:
            bad.append(f"{name}: no such option")
            continue
        nxt = words[i + 1] if i + 1 < cut else ""
        if action.choices and "|" in nxt:
            wrong = [c for c in nxt.split("|") if c not in action.choices]
            if wrong:
                bad.append(f"{name}: not a choice: {', '.join(wrong)}")
    return "; ".join(bad)


# ---------------------------------------------------------------- click (tide)


def _root() -> click.Command:
    import typer.main

    from tide.services.cli.main import app

    return typer.main.get_command(app)


def _choices(param: click.Parameter) -> list[str] | None:
    desc = getattr(param, "type_descriptor", None)
    if desc is None or not desc.is_choice or desc.choices is None:
        return None
    return [str(getattr(c, "value", c)) for c in desc.choices]


def _rest(ctx: click.Context) -> list[str]:
    return [*ctx._protected_args, *ctx.args]


# Read commands that take --db: after the parse they run for real against an empty
# store, which checks what the parser leaves to the command (times, states, formats).
OFFLINE = frozenset({"jobs", "history", "explain", "chart", "whatif"})
ONLINE_ONLY = frozenset({"-w", "--watch", "--scaler", "--context"})


def check_click(words: list[str], mode: str, empty_db: str = "") -> tuple[str, bool]:
    """(why the words fail, '' if not; whether they also ran against an empty store)."""
    problem = _click_parse(words, mode)
    if problem or mode != "full" or not empty_db:
        return problem, False
    args = substitute(words)
    if not args or args[0] not in OFFLINE or ONLINE_ONLY & set(args):
        return "", False
    if "--db" in args:  # the store it names: this one, empty
        i = args.index("--db")
        del args[i : i + 2]
    return _run_offline([*args, "--db", empty_db]), True


def _run_offline(args: list[str]) -> str:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = _root().main(args=args, prog_name="tide", standalone_mode=False)
    except SystemExit as e:
        code = e.code
    except typer.Exit as e:
        code = e.exit_code
    # 0, or 1: the job or decision is not in an empty store; 2 is a bad value.
    if code in (None, 0, 1):
        return ""
    return f"against an empty store it exits {code}: {out.getvalue().strip()[-300:]}"


def _click_parse(words: list[str], mode: str) -> str:
    root = _root()
    # The shell-completion options install into the caller's shell rc when parsed.
    for p in root.params:
        if p.name in ("install_completion", "show_completion"):
            p.callback = None
    if mode == "options":
        return _click_options(root, words)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            ctx = root.make_context("tide", substitute(words))
            cmd = root
            while isinstance(cmd, TyperGroup):
                rest = _rest(ctx)
                if not rest:
                    break
                name, sub, rest = cmd.resolve_command(ctx, rest)
                assert sub is not None and name is not None
                ctx = sub.make_context(name, rest, parent=ctx)
                cmd = sub
    except typer.Exit as e:
        return "" if e.exit_code == 0 else f"exited {e.exit_code}"
    except click.exceptions.NoArgsIsHelpError:
        return "incomplete: a group of commands, without one"
    except click.exceptions.MissingParameter as e:
        return f"incomplete: {e.format_message()}"
    except click.exceptions.UsageError as e:
        msg = e.format_message()
        if "requires an argument" in msg:
            return f"incomplete: {msg}"
        return f"its parser refuses it: {msg}"
    return ""


def _click_options(root: click.Command, words: list[str]) -> str:
    ctx = click.Context(root, info_name="tide")
    cmd = root
    bad: list[str] = []
    words = list(words)
    while words and isinstance(cmd, TyperGroup) and not words[0].startswith("-"):
        names = words.pop(0).split("|")
        subs = [cmd.get_command(ctx, n) for n in names]
        bad += [f"{n}: no such command" for n, s in zip(names, subs, strict=True) if s is None]
        if subs[0] is None:
            return "; ".join(bad)
        cmd = subs[0]
        ctx = click.Context(cmd, info_name=names[0], parent=ctx)
    opts = {o: p for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    for i, w in enumerate(words):
        if not w.startswith("-") or w == "-":
            continue
        name = w.split("=", 1)[0]
        # --live/--plain: a flag and its negation, both must exist
        missing = [n for n in name.split("/") if n not in opts]
        if missing:
            bad += [f"{n}: no such option of {ctx.command_path}" for n in missing]
            continue
        param = opts[name.split("/")[0]]
        nxt = words[i + 1] if i + 1 < len(words) else ""
        choices = _choices(param)
        if choices is not None and "|" in nxt:
            wrong = [c for c in nxt.split("|") if c not in choices]
            if wrong:
                bad.append(f"{name}: not a choice: {', '.join(wrong)}")
    return "; ".join(bad)


# ---------------------------------------------------------------- driver


def check(request: dict[str, Any], empty_db: str) -> tuple[str, bool]:
    saved = dict(os.environ)
    os.environ.update(request.get("env", {}))
    try:
        if request["kind"] == "tide":
            return check_click(request["words"], request["mode"], empty_db)
        problem = check_argparse(
            request["target"], request["kind"] == "file", request["words"], request["mode"]
        )
        return problem, False
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> None:
    src, dst, db_path = sys.argv[1:4]  # each check sets sys.argv
    with open(src) as f:
        requests = json.load(f)
    empty_db = f"sqlite:///{db_path}"
    assert _run_offline(["db", "upgrade", "--db", empty_db]) == ""
    done: dict[str, tuple[str, bool]] = {}  # the same line is often in several docs
    results = {}
    for r in requests:
        key = json.dumps([r[k] for k in ("kind", "target", "words", "mode", "env")])
        if key not in done:
            started = time.monotonic()
            done[key] = check(r, empty_db)
            if os.environ.get("TIDE_DOCS_TIMING"):
                print(f"{time.monotonic() - started:6.2f}s {key}", file=sys.stderr)
        results[r["id"]] = done[key]
    with open(dst, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
