"""Indexes that keep the decision path and start-up off the history's size.

- ``ix_decisions_open``: a partial index over the decisions that are not final
  (PENDING, PREPARING, ACTUATING). The exclusivity check of every new decision
  and a restarted scaler's scan for decisions to resume read it instead of the
  job's (or the store's) whole history: it holds a few rows whatever the
  history's size. Queries must repeat its predicate word for word (SQLite
  matches a partial index only on the same terms): tide/services/scaler/store/
  decisions.py builds both from OPEN_STATES. It replaces ``ix_decisions_state``:
  reads by a final state are most of the table, which no index helps.
- ``ix_utilization_rollups_minute``, ``ix_utilization_seconds_minute``:
  reads across all jobs by minute (the weekly GPU-hours runbook) and
  retention's batched deletes by minute; the primary key starts with job_id.

Revision ID: 0005_open_decisions
Revises: 0004_utilization_seconds
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_open_decisions"
down_revision: str | None = "0004_utilization_seconds"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A frozen copy of the predicate: a migration must not change when the models do.
_OPEN = "state IN ('PENDING', 'PREPARING', 'ACTUATING')"


def upgrade() -> None:
    op.create_index(
        "ix_decisions_open",
        "decisions",
        ["job_id", "created_at", "id"],
        sqlite_where=sa.text(_OPEN),
        postgresql_where=sa.text(_OPEN),
    )
    op.drop_index("ix_decisions_state", table_name="decisions")
    op.create_index("ix_utilization_rollups_minute", "utilization_rollups", ["minute"])
    op.create_index("ix_utilization_seconds_minute", "utilization_seconds", ["minute"])


def downgrade() -> None:
    op.drop_index("ix_utilization_seconds_minute", table_name="utilization_seconds")
    op.drop_index("ix_utilization_rollups_minute", table_name="utilization_rollups")
    op.create_index("ix_decisions_state", "decisions", ["state"])
    op.drop_index("ix_decisions_open", table_name="decisions")
