"""`tide db upgrade|downgrade`: the store's schema migrations (tide/services/store)."""

from __future__ import annotations

from typing import Annotated

import typer

from tide.base import errors
from tide.services.cli.app import exit_code_of, fail

DEFAULT_DB = "sqlite:///.tide/tide.db"

#: The schema commands' store; unlike the read commands' --db it has a default and an env var.
SchemaDbOpt = Annotated[str, typer.Option("--db", envvar="TIDE_DB", help="SQLAlchemy URL")]


def db_upgrade(
    db: SchemaDbOpt = DEFAULT_DB,
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
) -> None:
    """Upgrade the schema to the latest (or the given) revision."""
    from tide.services.store import db as store

    try:
        store.upgrade(db, revision)
        typer.echo(f"schema at {store.current_revision(db)}")
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))


def db_downgrade(
    revision: Annotated[str, typer.Argument(help="target revision, e.g. base")],
    db: SchemaDbOpt = DEFAULT_DB,
) -> None:
    """Downgrade the schema (destroys data of the dropped tables)."""
    from tide.services.store import db as store

    try:
        store.downgrade(db, revision)
        typer.echo(f"schema at {store.current_revision(db)}")
    except errors.TideError as exc:
        fail(exit_code_of(exc), str(exc))
