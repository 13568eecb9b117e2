"""Alembic environment: runs on the connection that tide.services.store.db hands over.

Without one (plain ``alembic`` CLI use), it builds its own from
``sqlalchemy.url`` or the TIDE_DB_URL environment variable.
"""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy.engine import Connection

# Importing the model modules registers their tables on Base.metadata.
import tide.services.store.models.coordinator
import tide.services.store.models.scaler  # noqa: F401
from tide.services.store.db import Base, make_engine

target_metadata = Base.metadata


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        compare_server_default=True,
    )


def run_migrations_offline() -> None:
    url = context.config.get_main_option("sqlalchemy.url") or os.environ["TIDE_DB_URL"]
    context.configure(
        url=url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=url.startswith("sqlite"),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _configure(connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    url = context.config.get_main_option("sqlalchemy.url") or os.environ["TIDE_DB_URL"]
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            _configure(conn)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
