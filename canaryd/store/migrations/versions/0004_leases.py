"""lease: which daemon of a fleet runs each backend's schedules, until when (PostgreSQL fleets)

One row per backend: the holder (a daemon process) and the expiry, on the database's clock. See
``canaryd/store/leases.py``; a SQLite database gets the table too (one schema), but no daemon writes it.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-03 20:20:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel  # noqa: F401  (autogenerate renders sqlmodel.sql.sqltypes.AutoString)
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lease",
        sa.Column("backend", sa.String(), nullable=False),
        sa.Column("holder", sa.String(), nullable=False),
        sa.Column("expires", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("backend"),
    )


def downgrade() -> None:
    op.drop_table("lease")
