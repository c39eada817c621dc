"""Alembic migrations of the history database (SQLite and PostgreSQL); run by ``canaryd.store.engine.migrate``."""
