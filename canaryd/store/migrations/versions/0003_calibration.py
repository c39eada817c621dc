"""calibration and detector: the calibrated noise model per backend × canary, and each backend's e-CUSUM

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 23:59:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel  # noqa: F401  (autogenerate renders sqlmodel.sql.sqltypes.AutoString)
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "calibration",
        sa.Column("backend", sa.String(), nullable=False),
        sa.Column("canary_id", sa.String(), nullable=False),
        sa.Column("request_hash", sa.String(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("regime", sa.String(), nullable=False),
        sa.Column("summary", sa.JSON(), nullable=False),
        sa.Column("model", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("backend", "canary_id"),
    )
    op.create_table(
        "detector",
        sa.Column("backend", sa.String(), nullable=False),
        sa.Column("statistic", sa.Float(), nullable=False),
        sa.Column("cycles", sa.Integer(), nullable=False),
        sa.Column("alarm", sa.Boolean(), nullable=False),
        sa.Column("pending", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("backend"),
    )


def downgrade() -> None:
    op.drop_table("detector")
    op.drop_table("calibration")
