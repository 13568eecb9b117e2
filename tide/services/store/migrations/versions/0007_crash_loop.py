"""The coordinator's crash-loop limit and exact lost steps.

- ``coordinator_jobs.failure`` / ``failed_at``: why and when a job failed for good
  (its workers crashed at every start until the restart budget was spent). Rows
  from before have not failed: NULL.
- ``coordinator_generations.reached_step`` / ``restored_step``: the step the
  generation before reached and the one its workers actually restored; lost steps
  are their difference. Rows from before keep their lost steps, reached 0 and
  restored NULL (never recounted).

Revision ID: 0007_crash_loop
Revises: 0006_leader_leases
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_crash_loop"
down_revision: str | None = "0006_leader_leases"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_TS = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("coordinator_jobs") as batch:
        batch.add_column(sa.Column("failure", sa.Text(), nullable=True))
        batch.add_column(sa.Column("failed_at", _TS, nullable=True))
    with op.batch_alter_table("coordinator_generations") as batch:
        batch.add_column(
            sa.Column("reached_step", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("restored_step", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("coordinator_generations") as batch:
        batch.drop_column("restored_step")
        batch.drop_column("reached_step")
    with op.batch_alter_table("coordinator_jobs") as batch:
        batch.drop_column("failed_at")
        batch.drop_column("failure")
