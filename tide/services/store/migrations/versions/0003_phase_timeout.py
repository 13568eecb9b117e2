"""Rename the stored policy override sync_timeout_s to phase_timeout_s.

The scaler's per-phase deadline was called sync_timeout_s before 0.2. Jobs
upserted then keep it in jobs.policy_overrides; renaming it once here keeps
their override without the repository translating names on every read. Where
both names are stored, phase_timeout_s was written later and wins.

Revision ID: 0003_phase_timeout
Revises: 0002_coordinator
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_phase_timeout"
down_revision: str | None = "0002_coordinator"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A frozen copy of the one column this migration touches.
_JOBS = sa.table(
    "jobs",
    sa.column("job_id", sa.String(253)),
    sa.column("policy_overrides", sa.JSON()),
)


def _rename(old: str, new: str) -> None:
    conn = op.get_bind()
    for job_id, overrides in conn.execute(sa.select(_JOBS.c.job_id, _JOBS.c.policy_overrides)):
        if not overrides or old not in overrides:
            continue
        renamed = dict(overrides)
        value = renamed.pop(old)
        renamed.setdefault(new, value)
        conn.execute(
            sa.update(_JOBS).where(_JOBS.c.job_id == job_id).values(policy_overrides=renamed)
        )


def upgrade() -> None:
    _rename("sync_timeout_s", "phase_timeout_s")


def downgrade() -> None:
    _rename("phase_timeout_s", "sync_timeout_s")
