"""Alembic migrations of the history database (SQLite and PostgreSQL); run by ``store.engine.migrate``."""
