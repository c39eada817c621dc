"""baseline.configuration, calibration.configuration: one baseline and noise model per serving configuration

A backend may answer from several serving configurations (a load balancer over servers with other
dtypes, a router over providers): each configuration now has its own baseline and calibration, keyed by
``canaryd.stack.configuration_of`` the baseline's stack ("" when the stack names none).

Existing rows: a baseline gets the configuration of its baseline observation's stored stack, so that an
upgraded database's next probe finds its baseline (a configuration computed with the identity fields of
this revision, frozen below: a later allow-list needs its own migration). A calibration gets its
baseline's configuration: it was measured against the stack that baseline came from.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-05 13:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from canaryd.stack import configuration_of

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

IDENTITY_FIELDS_0006 = (
    "response.system_fingerprint",
    "response.provider",
    "header.x-openrouter-provider",
    "header.azureml-model-session",
    "header.x-ms-region",
    "gateway.model_id",
    "gateway.api_base",
)
_TABLES = ("baseline", "calibration")


def _rekey(table: str, key: Sequence[str], add: bool) -> None:
    """Add (or drop) ``configuration``, part of the primary key ``key``: ALTERs on PostgreSQL, a copy of
    the table on SQLite (which cannot change a primary key in place: the copy's key is its columns' flags)."""
    sqlite = op.get_bind().dialect.name == "sqlite"
    with op.batch_alter_table(table, recreate="always" if sqlite else "auto") as batch:
        if not sqlite:
            batch.drop_constraint(f"{table}_pkey", type_="primary")
        if add:
            column = sa.Column(
                "configuration", sa.String(), server_default="", nullable=False, primary_key=sqlite
            )
            batch.add_column(column)
        else:
            batch.drop_column("configuration")
        batch.create_primary_key(f"{table}_pkey", list(key))


def upgrade() -> None:
    for table in _TABLES:
        _rekey(table, ("backend", "canary_id", "configuration"), add=True)
    conn = op.get_bind()
    rows = conn.execute(
        sa.text(
            "SELECT b.backend, b.canary_id, s.fields FROM baseline b JOIN event e ON e.id = b.observation_id "
            "JOIN outcome o ON o.id = e.outcome_id JOIN stack s ON s.hash = o.stack_hash"
        )
    ).all()
    for backend, canary_id, fields in rows:
        if isinstance(fields, str):  # SQLite's JSON comes back as text through a plain statement
            import json

            fields = json.loads(fields)
        configuration = configuration_of(fields or {}, IDENTITY_FIELDS_0006)
        if not configuration:
            continue
        key = {"b": backend, "c": canary_id, "k": configuration}
        for table in _TABLES:
            conn.execute(
                sa.text(f"UPDATE {table} SET configuration = :k WHERE backend = :b AND canary_id = :c"), key
            )


def downgrade() -> None:
    # one row per backend × canary again: the most recently accepted configuration's
    for table, stamp in (("baseline", "accepted_at"), ("calibration", "created_at")):
        op.execute(
            f"DELETE FROM {table} WHERE EXISTS (SELECT 1 FROM {table} n WHERE n.backend = {table}.backend "
            f"AND n.canary_id = {table}.canary_id AND (n.{stamp} > {table}.{stamp} OR (n.{stamp} = "
            f"{table}.{stamp} AND n.configuration > {table}.configuration)))"
        )
        _rekey(table, ("backend", "canary_id"), add=False)
