"""event.latency_evidence: a calibrated latency's evidence moves from the outcome to its probe's event

The outcome is stored once per content hash, so that an unchanged answer costs one thin event. A
calibrated latency's evidence (its statistic, p-value, the probe's value) differs on every probe, and
inside the outcome's comparison it made every outcome new. From this revision it is written on the event
and the outcome's comparison holds ``"latency": null``; the observation view carries the column and the
store's reader puts it back into the comparison. Rows written before keep it in the outcome.

Downgrading drops the column, and with it the latency evidence recorded since.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-07 06:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_COLUMNS = """
SELECT e.id AS id, e.run_id AS run_id, ru.instance AS instance, o.backend AS backend,
       o.canary_id AS canary_id, o.suite AS suite,
       e.started_at AS started_at, e.latency_s AS latency_s, r.body AS request,
       o.request_hash AS request_hash,
       o.text AS text, o.finish_reason AS finish_reason, o.prompt_tokens AS prompt_tokens,
       o.completion_tokens AS completion_tokens, o.reasoning_tokens AS reasoning_tokens,
       o.has_logprobs AS has_logprobs, o.system_fingerprint AS system_fingerprint,
       o.response_model AS response_model, e.headers AS headers, o.stack_hash AS stack_hash,
       o.payload_hash AS payload_hash, o.error AS error, o.error_kind AS error_kind, o.correct AS correct,
       o.verdict AS verdict, o.comparison AS comparison, o.baseline_id AS baseline_id{new}
FROM event e JOIN outcome o ON o.id = e.outcome_id JOIN request r ON r.hash = o.request_ref
     JOIN run ru ON ru.id = e.run_id
"""
OBSERVATION_VIEW = _COLUMNS.format(new=",\n       e.latency_evidence AS latency_evidence")
PREVIOUS_VIEW = _COLUMNS.format(new="")  # 0005's


def upgrade() -> None:
    op.execute("DROP VIEW observation")  # a view's columns cannot be altered
    op.add_column("event", sa.Column("latency_evidence", sa.JSON(), nullable=True))
    op.execute(f"CREATE VIEW observation AS {OBSERVATION_VIEW}")


def downgrade() -> None:
    op.execute("DROP VIEW observation")
    op.drop_column("event", "latency_evidence")
    op.execute(f"CREATE VIEW observation AS {PREVIOUS_VIEW}")
