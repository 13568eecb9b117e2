"""The scaler's tables: jobs, decisions, decision_events, utilization_rollups.

Revision ID: 0001_scaler
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001_scaler"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when models do.
_TS = sa.DateTime(timezone=True)
_BIGINT_PK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("job_id", sa.String(253), nullable=False),
        sa.Column("min_replicas", sa.Integer(), nullable=False),
        sa.Column("max_replicas", sa.Integer(), nullable=False),
        sa.Column("current_replicas", sa.Integer(), nullable=False),
        sa.Column("gpus_per_replica", sa.Integer(), nullable=False),
        sa.Column("policy_overrides", sa.JSON(), nullable=False),
        sa.Column("autoscaling_paused", sa.Boolean(), nullable=False),
        sa.Column("pause_reason", sa.Text(), nullable=False),
        sa.Column("paused_at", _TS, nullable=True),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("last_resize_ended_at", _TS, nullable=True),
        sa.Column("owner_epoch", sa.BigInteger(), nullable=False),
        sa.Column("owner_id", sa.String(255), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name="pk_jobs"),
    )
    op.create_table(
        "decisions",
        sa.Column("id", _BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(253), nullable=False),
        sa.Column("from_replicas", sa.Integer(), nullable=False),
        sa.Column("to_replicas", sa.Integer(), nullable=False),
        sa.Column("reason", sa.String(64), nullable=False),
        sa.Column("trigger", sa.String(32), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("inputs", sa.JSON(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("error", sa.Text(), nullable=False),
        sa.Column("pause_s", sa.Double(), nullable=False),
        sa.Column("lost_steps", sa.BigInteger(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("requested_by", sa.String(255), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("ended_at", _TS, nullable=True),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.job_id"], name="fk_decisions_job_id_jobs", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name="pk_decisions"),
    )
    op.create_index("ix_decisions_job_id_created_at", "decisions", ["job_id", "created_at"])
    op.create_index("ix_decisions_created_at_id", "decisions", ["created_at", "id"])
    op.create_index("ix_decisions_state", "decisions", ["state"])
    op.create_table(
        "decision_events",
        sa.Column("id", _BIGINT_PK, autoincrement=True, nullable=False),
        sa.Column("decision_id", sa.BigInteger(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("at", _TS, nullable=False),
        sa.Column("detail", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(
            ["decision_id"],
            ["decisions.id"],
            name="fk_decision_events_decision_id_decisions",
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_decision_events"),
    )
    op.create_index("ix_decision_events_decision_id_at", "decision_events", ["decision_id", "at"])
    op.create_table(
        "utilization_rollups",
        sa.Column("job_id", sa.String(253), nullable=False),
        sa.Column("minute", _TS, nullable=False),
        sa.Column("mean_pct", sa.Double(), nullable=False),
        sa.Column("min_pct", sa.Double(), nullable=False),
        sa.Column("max_pct", sa.Double(), nullable=False),
        sa.Column("samples", sa.BigInteger(), nullable=False),
        sa.Column("replicas", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", "minute", name="pk_utilization_rollups"),
    )


def downgrade() -> None:
    op.drop_table("utilization_rollups")
    op.drop_index("ix_decision_events_decision_id_at", table_name="decision_events")
    op.drop_table("decision_events")
    op.drop_index("ix_decisions_state", table_name="decisions")
    op.drop_index("ix_decisions_created_at_id", table_name="decisions")
    op.drop_index("ix_decisions_job_id_created_at", table_name="decisions")
    op.drop_table("decisions")
    op.drop_table("jobs")
