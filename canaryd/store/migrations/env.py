"""Alembic environment for canaryd's history database.

Run by ``store.engine.migrate`` (which hands over an open connection inside its own transaction, holding
the migration lock), by ``canaryd db upgrade``, or by a developer through the repository's ``alembic.ini``
(``alembic revision --autogenerate -m "..."``). ``render_as_batch`` makes autogenerate write SQLite-safe
batch operations; the ``observation`` view is excluded from autogenerate and written by hand in the
revisions (``op.execute``), with each revision carrying its own copy of the view's SQL.
"""

from alembic import context
from sqlmodel import SQLModel

from canaryd.store import schema  # noqa: F401  (the tables, into SQLModel.metadata)
from canaryd.store.engine import AUTOGENERATE_OPTIONS, make_engine

config = context.config


def _configure(**kw) -> None:
    context.configure(
        target_metadata=SQLModel.metadata,
        render_as_batch=True,
        **AUTOGENERATE_OPTIONS,
        **kw,
    )


if context.is_offline_mode():  # `alembic upgrade --sql`: print the SQL
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
elif (connection := config.attributes.get("connection")) is not None:
    _configure(connection=connection)
    with context.begin_transaction():  # a no-op inside the caller's transaction
        context.run_migrations()
else:
    engine = make_engine(config.get_main_option("sqlalchemy.url"))
    try:
        with engine.connect() as connection:
            _configure(connection=connection)
            with context.begin_transaction():
                context.run_migrations()
    finally:
        engine.dispose()
