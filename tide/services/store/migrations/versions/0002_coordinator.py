"""The coordinator's tables: jobs' counters, members, generations, checkpoints,
resizes and directives.

Revision ID: 0002_coordinator
Revises: 0001_scaler
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_coordinator"
down_revision: str | None = "0001_scaler"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the model types: a migration must not change when models do.
_TS = sa.DateTime(timezone=True)
_JOB = sa.String(253)
_MEMBER = sa.String(300)


def _job_fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(
        ["job_id"],
        ["coordinator_jobs.job_id"],
        name=f"fk_{table}_job_id_coordinator_jobs",
        ondelete="CASCADE",
    )


def upgrade() -> None:
    op.create_table(
        "coordinator_jobs",
        sa.Column("job_id", _JOB, nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("directive_seq", sa.BigInteger(), nullable=False),
        sa.Column("lost_steps_total", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", _TS, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("job_id", name="pk_coordinator_jobs"),
    )
    op.create_table(
        "coordinator_members",
        sa.Column("member_id", _MEMBER, nullable=False),
        sa.Column("job_id", _JOB, nullable=False),
        sa.Column("pod_name", sa.String(253), nullable=False),
        sa.Column("pod_index", sa.Integer(), nullable=False),
        sa.Column("pod_uid", sa.String(128), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("launcher_id", sa.String(128), nullable=False),
        sa.Column("free_port", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=True),
        sa.Column("registered_at", _TS, nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        _job_fk("coordinator_members"),
        sa.PrimaryKeyConstraint("member_id", name="pk_coordinator_members"),
    )
    op.create_index("ix_coordinator_members_job_id", "coordinator_members", ["job_id"])
    op.create_table(
        "coordinator_generations",
        sa.Column("job_id", _JOB, nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("member_ids", sa.JSON(), nullable=False),
        sa.Column("master_endpoint", sa.String(300), nullable=False),
        sa.Column("trainer_endpoints", sa.JSON(), nullable=False),
        sa.Column("restore_step", sa.BigInteger(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("decision_id", sa.BigInteger(), nullable=True),
        sa.Column("lost_steps", sa.BigInteger(), nullable=False),
        _job_fk("coordinator_generations"),
        sa.PrimaryKeyConstraint("job_id", "generation", name="pk_coordinator_generations"),
    )
    op.create_table(
        "coordinator_checkpoints",
        sa.Column("job_id", _JOB, nullable=False),
        sa.Column("step", sa.BigInteger(), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("digest", sa.String(128), nullable=False),
        sa.Column("good", sa.Boolean(), nullable=False),
        sa.Column("write_s", sa.Double(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        _job_fk("coordinator_checkpoints"),
        sa.PrimaryKeyConstraint("job_id", "step", "generation", name="pk_coordinator_checkpoints"),
    )
    op.create_table(
        "coordinator_resizes",
        sa.Column("decision_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("job_id", _JOB, nullable=False),
        sa.Column("target_world_size", sa.Integer(), nullable=False),
        sa.Column("min_world_size", sa.Integer(), nullable=False),
        sa.Column("leaving_pods", sa.JSON(), nullable=False),
        sa.Column("deadline_s", sa.Double(), nullable=False),
        sa.Column("phase", sa.String(24), nullable=False),
        sa.Column("from_generation", sa.BigInteger(), nullable=False),
        sa.Column("to_generation", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint_step", sa.BigInteger(), nullable=False),
        sa.Column("participants", sa.JSON(), nullable=False),
        sa.Column("newcomers", sa.JSON(), nullable=False),
        sa.Column("leaving", sa.JSON(), nullable=False),
        sa.Column("acked", sa.JSON(), nullable=False),
        sa.Column("started_at", _TS, nullable=False),
        sa.Column("phase_started_at", _TS, nullable=False),
        sa.Column("held_at_latest", _TS, nullable=True),
        sa.Column("rendezvous_sent_at", _TS, nullable=True),
        sa.Column("finished_at", _TS, nullable=True),
        sa.Column("checkpoint_digest", sa.String(128), nullable=False),
        sa.Column("checkpoint_write_s", sa.Double(), nullable=False),
        sa.Column("pause_s", sa.Double(), nullable=False),
        sa.Column("breakdown", sa.JSON(), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        _job_fk("coordinator_resizes"),
        sa.PrimaryKeyConstraint("decision_id", name="pk_coordinator_resizes"),
    )
    op.create_index(
        "ix_coordinator_resizes_job_id_started_at",
        "coordinator_resizes",
        ["job_id", "started_at"],
    )
    op.create_table(
        "coordinator_directives",
        sa.Column("job_id", _JOB, nullable=False),
        sa.Column("directive_id", sa.String(64), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("member_id", _MEMBER, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("generation", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint_step", sa.BigInteger(), nullable=False),
        sa.Column("rendezvous", sa.JSON(), nullable=True),
        sa.Column("deadline_at", _TS, nullable=True),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("acked", sa.Boolean(), nullable=False),
        sa.Column("ack_ok", sa.Boolean(), nullable=False),
        sa.Column("superseded", sa.Boolean(), nullable=False),
        sa.Column("created_at", _TS, nullable=False),
        _job_fk("coordinator_directives"),
        sa.PrimaryKeyConstraint("job_id", "directive_id", name="pk_coordinator_directives"),
    )
    op.create_index(
        "ix_coordinator_directives_job_id_seq", "coordinator_directives", ["job_id", "seq"]
    )


def downgrade() -> None:
    op.drop_index("ix_coordinator_directives_job_id_seq", table_name="coordinator_directives")
    op.drop_table("coordinator_directives")
    op.drop_index("ix_coordinator_resizes_job_id_started_at", table_name="coordinator_resizes")
    op.drop_table("coordinator_resizes")
    op.drop_table("coordinator_checkpoints")
    op.drop_table("coordinator_generations")
    op.drop_index("ix_coordinator_members_job_id", table_name="coordinator_members")
    op.drop_table("coordinator_members")
    op.drop_table("coordinator_jobs")
