"""Leader election among scaler replicas, and the epoch of every decision event.

- ``leader_leases``: one row per lease name; the replica whose row has not
  expired leads (tide/services/scaler/leases.py). ``epoch`` grows at every change of
  holder.
- ``decision_events.owner_epoch``: the job's owner epoch its writer held, so the
  history shows that no old leader wrote after a new one took the job (events
  of a job never go back to an older epoch). Rows from before are 0.

Revision ID: 0006_leader_leases
Revises: 0005_open_decisions
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_leader_leases"
down_revision: str | None = "0005_open_decisions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "leader_leases",
        sa.Column("name", sa.String(64), nullable=False),
        sa.Column("holder", sa.String(255), nullable=False),
        sa.Column("address", sa.String(255), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", _TS, nullable=False),
        sa.Column("renewed_at", _TS, nullable=False),
        sa.Column("expires_at", _TS, nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_leader_leases"),
    )
    with op.batch_alter_table("decision_events") as batch:
        batch.add_column(
            sa.Column("owner_epoch", sa.BigInteger(), nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("decision_events") as batch:
        batch.drop_column("owner_epoch")
    op.drop_table("leader_leases")
