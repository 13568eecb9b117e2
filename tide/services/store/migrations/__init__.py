"""Alembic migrations of the Tide schema; run them through tide.services.store.db.upgrade."""
