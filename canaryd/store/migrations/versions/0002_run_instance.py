"""run.instance: which canaryd instance probed (several daemons can share one database)

Runs from before this revision get "" (unknown). The ``observation`` view gains ``instance`` (from run).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 15:57:46.170798
"""

from collections.abc import Sequence

import sqlalchemy as sa
import sqlmodel  # noqa: F401  (autogenerate renders sqlmodel.sql.sqltypes.AutoString)
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OBSERVATION_VIEW = """
SELECT e.id AS id, e.run_id AS run_id, ru.instance AS instance, o.backend AS backend,
       o.canary_id AS canary_id, o.suite AS suite,
       e.started_at AS started_at, e.latency_s AS latency_s, r.body AS request,
       o.request_hash AS request_hash,
       o.text AS text, o.finish_reason AS finish_reason, o.prompt_tokens AS prompt_tokens,
       o.completion_tokens AS completion_tokens, o.system_fingerprint AS system_fingerprint,
       o.response_model AS response_model, e.headers AS headers, o.stack_hash AS stack_hash,
       o.payload_hash AS payload_hash, o.error AS error, o.error_kind AS error_kind, o.correct AS correct,
       o.verdict AS verdict, o.comparison AS comparison, o.baseline_id AS baseline_id
FROM event e JOIN outcome o ON o.id = e.outcome_id JOIN request r ON r.hash = o.request_ref
     JOIN run ru ON ru.id = e.run_id
"""

PREVIOUS_VIEW = """
SELECT e.id AS id, e.run_id AS run_id, o.backend AS backend, o.canary_id AS canary_id, o.suite AS suite,
       e.started_at AS started_at, e.latency_s AS latency_s, r.body AS request,
       o.request_hash AS request_hash,
       o.text AS text, o.finish_reason AS finish_reason, o.prompt_tokens AS prompt_tokens,
       o.completion_tokens AS completion_tokens, o.system_fingerprint AS system_fingerprint,
       o.response_model AS response_model, e.headers AS headers, o.stack_hash AS stack_hash,
       o.payload_hash AS payload_hash, o.error AS error, o.error_kind AS error_kind, o.correct AS correct,
       o.verdict AS verdict, o.comparison AS comparison, o.baseline_id AS baseline_id
FROM event e JOIN outcome o ON o.id = e.outcome_id JOIN request r ON r.hash = o.request_ref
"""


def upgrade() -> None:
    op.execute("DROP VIEW observation")  # a view's columns cannot be inserted (PostgreSQL) or altered
    # SQLite adds a NOT NULL column with a default in place (ALTER TABLE ADD COLUMN): no table copy.
    with op.batch_alter_table("run", schema=None) as batch_op:
        batch_op.add_column(sa.Column("instance", sa.String(), server_default="", nullable=False))
    op.execute(f"CREATE VIEW observation AS {OBSERVATION_VIEW}")


def downgrade() -> None:
    op.execute("DROP VIEW observation")
    # Not batch mode: SQLite (>= 3.35) drops the column in place, where a table copy would trip over the
    # foreign keys from event to run.
    op.drop_column("run", "instance")
    op.execute(f"CREATE VIEW observation AS {PREVIOUS_VIEW}")
