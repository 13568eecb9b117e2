"""The `tide` typer app and what every command shares: exit codes, one-line failures,
running a command's coroutine, output formats, the console and time options.

Exit codes, for every command: 0 ok, 1 not found, 2 bad usage or bad input,
3 server or database unreachable, 4 `tide demo` failed (or `tide up` lost a
service), 5 `tide scale --wait`: the decision did not complete, 130
interrupted (Ctrl-C) where the command had not finished. A failure prints one line saying why.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from datetime import UTC, datetime
from enum import IntEnum
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer

from tide.base import errors
from tide.services.cli.timeparse import parse_duration_s, parse_time

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")


class Exit(IntEnum):
    OK = 0
    NOT_FOUND = 1
    USAGE = 2
    UNREACHABLE = 3
    #: `tide demo` ran and failed its checks (or was stopped); `tide up` lost a service.
    FAILED = 4
    #: `tide scale --wait`: the decision ended ABORTED or FAILED.
    DECISION_NOT_COMPLETED = 5
    #: SIGINT (Ctrl-C) before the command finished: the shells' 128 + 2.
    INTERRUPTED = 130


app = typer.Typer(
    name="tide",
    help="Tide: elastic training for PaddlePaddle. Operate the services, read the scaling history.",
    no_args_is_help=True,
    # --install-completion / --show-completion for bash, zsh, fish and PowerShell.
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib import metadata

        try:
            version = metadata.version("tide")
        except metadata.PackageNotFoundError:
            version = "unknown"
        typer.echo(f"tide {version}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="print the version"),
    ] = False,
) -> None:
    """Tide: elastic training for PaddlePaddle. Operate the services, read the scaling history."""


job_app = typer.Typer(help="Create and update jobs (UpsertJob).", no_args_is_help=True)
app.add_typer(job_app, name="job")
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
app.add_typer(db_app, name="db")


def fail(code: Exit, message: str) -> NoReturn:
    """Print one line to stderr and exit with ``code``."""
    # Driver errors (psycopg's) span lines; the convention is one line per failure.
    typer.echo(f"tide: {' '.join(message.split())}", err=True)
    raise typer.Exit(int(code))


def exit_code_of(exc: errors.TideError) -> Exit:
    if isinstance(exc, errors.NotFound):
        return Exit.NOT_FOUND
    if isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded)):
        return Exit.UNREACHABLE
    return Exit.USAGE


def run(coro: Coroutine[Any, Any, T], *, interrupted: Exit = Exit.INTERRUPTED) -> T:
    """Run one command's coroutine; a TideError becomes its exit code and one line, and
    SIGINT (asyncio.run cancels the coroutine, even in a stream read) exits
    ``interrupted`` at once, without a traceback."""
    try:
        return asyncio.run(coro)
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))
    except KeyboardInterrupt:
        raise typer.Exit(int(interrupted)) from None


def console() -> Console:
    # rich is imported by the commands that draw with it, not at every start-up.
    from rich.console import Console

    # Piped output keeps whole rows: a pager or grep should not see folded cells.
    return Console(width=None if sys.stdout.isatty() else 200, soft_wrap=False)


def echo(line: str) -> None:
    typer.echo(line)


def now_utc() -> datetime:
    return datetime.now(tz=UTC)


def duration_option(name: str, text: str) -> float:
    """Seconds of a duration option (``90s``, ``1h30m``), or exit 2 with one line."""
    try:
        return parse_duration_s(text)
    except errors.InvalidArgument as exc:
        fail(Exit.USAGE, f"{name}: {exc}")


def time_option(name: str, text: str | None) -> datetime | None:
    """The time a --since/--until option names, or exit 2 with one line."""
    if text is None:
        return None
    try:
        return parse_time(text, now_utc())
    except errors.InvalidArgument as exc:
        fail(Exit.USAGE, f"{name}: {exc}")
