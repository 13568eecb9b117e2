"""The `tide` command: operate the services and query the scaling history.

Exit codes, for every command: 0 ok, 1 not found, 2 bad usage or bad input,
3 server or database unreachable. A failure prints one line saying why.
"""

from __future__ import annotations

import sys
from enum import IntEnum
from typing import Annotated, NoReturn

import typer

from services.common import errors


class Exit(IntEnum):
    OK = 0
    NOT_FOUND = 1
    USAGE = 2
    UNREACHABLE = 3


app = typer.Typer(
    name="tide",
    help="Tide: elastic training for PaddlePaddle. Operate the services, read the scaling history.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
app.add_typer(db_app, name="db")

DEFAULT_DB = "sqlite:///.tide/tide.db"


def fail(code: Exit, message: str) -> NoReturn:
    """Print one line to stderr and exit with ``code``."""
    typer.echo(f"tide: {message}", err=True)
    raise typer.Exit(int(code))


def exit_code_of(exc: errors.TideError) -> Exit:
    if isinstance(exc, errors.NotFound):
        return Exit.NOT_FOUND
    if isinstance(exc, (errors.Unavailable, errors.DeadlineExceeded)):
        return Exit.UNREACHABLE
    return Exit.USAGE


@db_app.command("upgrade")
def db_upgrade(
    db: Annotated[str, typer.Option("--db", envvar="TIDE_DB", help="SQLAlchemy URL")] = DEFAULT_DB,
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
) -> None:
    """Upgrade the schema to the latest (or the given) revision."""
    from services.common import db as store

    try:
        store.upgrade(db, revision)
        typer.echo(f"schema at {store.current_revision(db)}")
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))


@db_app.command("downgrade")
def db_downgrade(
    revision: Annotated[str, typer.Argument(help="target revision, e.g. base")],
    db: Annotated[str, typer.Option("--db", envvar="TIDE_DB", help="SQLAlchemy URL")] = DEFAULT_DB,
) -> None:
    """Downgrade the schema (destroys data of the dropped tables)."""
    from services.common import db as store

    try:
        store.downgrade(db, revision)
        typer.echo(f"schema at {store.current_revision(db)}")
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))


def main() -> None:
    try:
        app()
    except errors.TideError as exc:  # a command that did not catch its own
        typer.echo(f"tide: {exc}", err=True)
        sys.exit(int(exit_code_of(exc)))


if __name__ == "__main__":
    main()
