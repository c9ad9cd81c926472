"""quality views; row-level security on every table with a tenant column (PostgreSQL)

The policies themselves, and read access for analysts, come with 0008 (``analyst_grants``).

Revision ID: 0005
Revises: 0004
"""

from alembic import op


revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

#: Tables with a tenant column at this revision.
TENANT_TABLES = ("documents", "stage_results", "llm_cache", "llm_calls", "dead_letters", "golden_examples",
                 "eval_runs", "eval_results", "drift_alerts", "review_queue")

# One row per pipeline × tenant × stage × model × day, from every attempt in llm_calls.
QUALITY_DAILY = """
SELECT pipeline, tenant, stage, model, {day} AS day,
  count(*) FILTER (WHERE outcome IN ('ok', 'cache_hit', 'failed')) AS stage_runs,
  count(*) FILTER (WHERE outcome <> 'cache_hit') AS llm_calls,
  count(*) FILTER (WHERE outcome = 'cache_hit') AS cache_hits,
  1.0 * count(*) FILTER (WHERE outcome = 'cache_hit')
      / nullif(count(*) FILTER (WHERE outcome IN ('ok', 'cache_hit', 'failed')), 0) AS cache_hit_rate,
  1.0 * count(*) FILTER (WHERE outcome = 'failed')
      / nullif(count(*) FILTER (WHERE outcome IN ('ok', 'cache_hit', 'failed')), 0) AS failure_rate,
  1.0 * count(*) FILTER (WHERE error = 'schema_invalid') / nullif(count(*) FILTER (WHERE outcome <> 'cache_hit'), 0)
      AS schema_invalid_rate,
  1.0 * count(*) FILTER (WHERE error = 'semantic_invalid') / nullif(count(*) FILTER (WHERE outcome <> 'cache_hit'), 0)
      AS semantic_invalid_rate,
  1.0 * count(*) FILTER (WHERE error = 'refusal') / nullif(count(*) FILTER (WHERE outcome <> 'cache_hit'), 0)
      AS refusal_rate,
  1.0 * count(*) FILTER (WHERE error = 'truncated') / nullif(count(*) FILTER (WHERE outcome <> 'cache_hit'), 0)
      AS truncation_rate,
  1.0 * count(*) FILTER (WHERE error IN ('provider_error', 'timeout'))
      / nullif(count(*) FILTER (WHERE outcome <> 'cache_hit'), 0) AS provider_failure_rate,
  {p50} AS latency_p50_ms, {p95} AS latency_p95_ms, {p99} AS latency_p99_ms,
  coalesce(sum(tokens_in + tokens_out) FILTER (WHERE outcome <> 'cache_hit'), 0) AS tokens,
  coalesce(sum(cost) FILTER (WHERE outcome <> 'cache_hit'), 0) AS cost,
  coalesce(sum(cost) FILTER (WHERE outcome = 'cache_hit'), 0) AS saved
FROM llm_calls
GROUP BY pipeline, tenant, stage, model, {day}
"""

EVAL_TREND = """
SELECT pipeline, tenant, stage, model, fingerprint, created_at, examples, failed, accuracy, macro_f1
FROM eval_runs
"""


def _pct(q: float) -> str:
    return f"percentile_cont({q}) WITHIN GROUP (ORDER BY latency_ms) FILTER (WHERE outcome = 'ok')"


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        daily = QUALITY_DAILY.format(day="(created_at AT TIME ZONE 'UTC')::date", p50=_pct(0.5), p95=_pct(0.95),
                                     p99=_pct(0.99))
        # security_invoker: the view reads with the caller's rights, so row-level security applies.
        op.execute(f"CREATE VIEW quality_daily WITH (security_invoker = true) AS {daily}")
        op.execute(f"CREATE VIEW eval_trend WITH (security_invoker = true) AS {EVAL_TREND}")
        for table in TENANT_TABLES:
            op.execute(f'ALTER TABLE "{table}" ENABLE ROW LEVEL SECURITY')
    else:
        # SQLite has no percentile aggregate: `etl quality` computes latency percentiles itself.
        op.execute("CREATE VIEW quality_daily AS " + QUALITY_DAILY.format(
            day="date(created_at)", p50="NULL", p95="NULL", p99="NULL"))
        op.execute(f"CREATE VIEW eval_trend AS {EVAL_TREND}")


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS eval_trend")
    op.execute("DROP VIEW IF EXISTS quality_daily")
