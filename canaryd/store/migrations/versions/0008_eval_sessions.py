"""eval_session: an evaluation run under canaryd, with its harness, samples and the runs around it

``canaryd.api.Session`` and ``canaryd preflight`` write one row per session: the harness and task, the
sample count, the serving configurations that answered the samples (id → count), the runs that checked
the stack before and after, and whether it held. ``canaryd record`` and the HTML report read it.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-06 10:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "eval_session",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("harness", sa.String(), nullable=False),
        sa.Column("task", sa.String(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("configurations", sa.JSON(), nullable=False),
        sa.Column("runs_before", sa.JSON(), nullable=False),
        sa.Column("runs_after", sa.JSON(), nullable=False),
        sa.Column("held", sa.Boolean(), nullable=True),
        sa.Column("out_dir", sa.String(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("eval_session")
