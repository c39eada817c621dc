"""outcome.reasoning_tokens, outcome.has_logprobs (answers judged on text and usage), lease.presence

``reasoning_tokens`` is ``usage.completion_tokens_details.reasoning_tokens`` (hidden reasoning a model
spent); ``has_logprobs`` says whether the answer carried per-token logprobs. Rows written before this
revision leave it NULL: they had logprobs exactly when they have a payload. ``lease.presence`` names the
holder's presence connection, so a killed holder's leases end at once (``canaryd/store/leases.py``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-04 14:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = """
SELECT e.id AS id, e.run_id AS run_id, ru.instance AS instance, o.backend AS backend,
       o.canary_id AS canary_id, o.suite AS suite,
       e.started_at AS started_at, e.latency_s AS latency_s, r.body AS request,
       o.request_hash AS request_hash,
       o.text AS text, o.finish_reason AS finish_reason, o.prompt_tokens AS prompt_tokens,
       o.completion_tokens AS completion_tokens,{new} o.system_fingerprint AS system_fingerprint,
       o.response_model AS response_model, e.headers AS headers, o.stack_hash AS stack_hash,
       o.payload_hash AS payload_hash, o.error AS error, o.error_kind AS error_kind, o.correct AS correct,
       o.verdict AS verdict, o.comparison AS comparison, o.baseline_id AS baseline_id
FROM event e JOIN outcome o ON o.id = e.outcome_id JOIN request r ON r.hash = o.request_ref
     JOIN run ru ON ru.id = e.run_id
"""
OBSERVATION_VIEW = _COLUMNS.format(
    new=" o.reasoning_tokens AS reasoning_tokens, o.has_logprobs AS has_logprobs,"
)
PREVIOUS_VIEW = _COLUMNS.format(new="")


def upgrade() -> None:
    op.execute("DROP VIEW observation")  # a view's columns cannot be inserted (PostgreSQL) or altered
    with op.batch_alter_table("outcome", schema=None) as batch_op:
        batch_op.add_column(sa.Column("reasoning_tokens", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("has_logprobs", sa.Boolean(), nullable=True))
    op.execute(f"CREATE VIEW observation AS {OBSERVATION_VIEW}")
    with op.batch_alter_table("lease", schema=None) as batch_op:
        batch_op.add_column(sa.Column("presence", sa.String(), nullable=True))


def downgrade() -> None:
    op.drop_column("lease", "presence")
    op.execute("DROP VIEW observation")
    op.drop_column("outcome", "has_logprobs")
    op.drop_column("outcome", "reasoning_tokens")
    op.execute(f"CREATE VIEW observation AS {PREVIOUS_VIEW}")
