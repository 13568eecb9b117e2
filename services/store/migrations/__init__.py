"""Alembic migrations of the Tide schema; run them through services.store.db.upgrade."""
