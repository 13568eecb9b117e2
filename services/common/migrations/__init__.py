"""Alembic migrations of the Tide schema; run them through services.common.db.upgrade."""
