"""daemon: the live daemons of a fleet; lease.weight, lease.probed: what each held backend weighs, when its
holder last set out to probe it (PostgreSQL fleets)

A fleet shares its backends by rendezvous hashing over the live daemons (``canaryd/shares.py``): each
daemon keeps a row (its presence connection, when it started, its last claim and its lease length), so
every daemon reads the same live set from the database. ``lease.weight`` is the backend's canaries ×
passes per hour, so that `canaryd fleet` shows each daemon's weighted share; ``lease.probed`` tells a
standby whether a holder that died after renewing a lease probed the backend before it died. See
``canaryd/store/leases.py``; a SQLite database gets the table too (one schema), but no daemon writes it.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-06 10:05:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel  # noqa: F401  (autogenerate renders sqlmodel.sql.sqltypes.AutoString)
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "daemon",
        sa.Column("holder", sa.String(), nullable=False),
        sa.Column("instance", sa.String(), nullable=False),
        sa.Column("presence", sa.String(), nullable=True),
        sa.Column("started", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("lease_s", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("holder"),
    )
    with op.batch_alter_table("lease") as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("probed", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lease") as batch_op:
        batch_op.drop_column("probed")
        batch_op.drop_column("weight")
    op.drop_table("daemon")
