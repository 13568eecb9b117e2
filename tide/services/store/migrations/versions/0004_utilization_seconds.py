"""Per-second utilization of each job minute (utilization_seconds), for `tide whatif`.

The minute rollups keep mean, min and max; replaying a policy whose buckets are
seconds long needs each second. The table is insert-only (one row per written
part of a minute) and has its own, shorter retention.

Revision ID: 0004_utilization_seconds
Revises: 0003_phase_timeout
Create Date: 2026-12-09
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_utilization_seconds"
down_revision: str | None = "0003_phase_timeout"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when models do.
_TS = sa.DateTime(timezone=True)
_BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "utilization_seconds",
        sa.Column("id", _BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(253), nullable=False),
        sa.Column("minute", _TS, nullable=False),
        sa.Column("sums", sa.JSON(), nullable=False),
        sa.Column("counts", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_utilization_seconds"),
    )
    op.create_index(
        "ix_utilization_seconds_job_id_minute", "utilization_seconds", ["job_id", "minute"]
    )


def downgrade() -> None:
    op.drop_index("ix_utilization_seconds_job_id_minute", table_name="utilization_seconds")
    op.drop_table("utilization_seconds")
