"""An OpenAI-compatible provider that fails in every way a real one does: 500 documents, mixed
faults, every document ends as a result or a correctly typed quarantine entry, every attempt is
in llm_calls with its cost, and a replay after the fix leaves quarantine exactly once."""

from __future__ import annotations

from collections import Counter

import pytest
from pydantic import BaseModel, Field

from etl import Extract, Pipeline
from etl.testing import FaultServer
from etl.llm.openai_compat import OpenAICompatibleLLM
from etl.runtime.wiring import build_runner
from etl.settings import Settings
from etl.testing import ListSource
from etl.validators import non_negative
from tests.helpers import counts, rows

#: fault directive per document (by index % 20), and how the document must end
PLAN = {
    0: ("[fault:429x2]", None), 1: ("[fault:500x1]", None), 2: ("[fault:500x9]", "provider_error"),
    3: ("[fault:slowx1]", None), 4: ("[fault:slowx9]", "timeout"), 5: ("[fault:truncated]", "truncated"),
    6: ("[fault:refusal]", "refusal"), 7: ("[fault:prose]", None), 8: ("[fault:invalid_once]", None),
    9: ("[fault:invalid]", "schema_invalid"), 10: ("[fault:negative]", "semantic_invalid"),
    11: ("[fault:context]", "context_overflow"),
}
N = 500
PRICE = (2.0, 8.0)  # USD per million tokens in, out


class Invoice(BaseModel):
    number: str = Field(description="the invoice number")
    total: float = Field(description="the amount due")


def docs() -> list[dict[str, str]]:
    return [{"id": f"inv-{i:03d}", "tenant": ["acme", "globex"][i % 2],
             "text": f"Invoice {i} total due {i * 3 % 97}.50 EUR {PLAN.get(i % 20, ('', None))[0]}"} for i in range(N)]


def pipeline(url: str, server: FaultServer) -> tuple[Pipeline, OpenAICompatibleLLM]:
    llm = OpenAICompatibleLLM(server.url, "fault-model", api_key="sk-test", structured="json_schema",
                              timeout_s=0.5, price_per_mtok=PRICE)
    stage = Extract(Invoice, "Extract the invoice.", validators=[non_negative("total")])
    return Pipeline("invoices", ListSource(docs()), [stage], store=url), llm


SETTINGS = Settings(llm_max_attempts=3, llm_max_retry_s=20, repairs=1, max_in_flight=64)


@pytest.mark.timeout(300)
async def test_mixed_faults_end_as_results_or_typed_quarantine(sqlite_url: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    with FaultServer(slow_s=1.0) as server:
        p, llm = pipeline(sqlite_url, server)
        stats = await build_runner(p, SETTINGS, llm=llm).run()
        await llm.aclose()
        quarantined = dict(rows(sqlite_url, "SELECT doc_key, reason FROM dead_letters WHERE status = 'open'"))
        results = {k for (k,) in rows(sqlite_url, "SELECT doc_key FROM stage_results")}
        outcomes = Counter(dict(rows(sqlite_url, "SELECT outcome, count(*) FROM llm_calls GROUP BY outcome")))
        tokens_in, tokens_out, cost = rows(sqlite_url, "SELECT sum(tokens_in), sum(tokens_out), sum(cost) FROM llm_calls")[0]
        with capsys.disabled():  # the figures belong in CI's output
            print(f"\nfault figures: documents={N} results={len(results)} quarantined={len(quarantined)} "
                  f"by_reason={dict(Counter(quarantined.values()))} llm_calls_by_outcome={dict(outcomes)} "
                  f"http_requests={server.requests} tokens={tokens_in}+{tokens_out} cost_usd={cost:.6f}")
        assert stats.messages == N == len(results) + len(quarantined)  # in == results + quarantined
        assert not results & set(quarantined)
        for i in range(N):
            expected = PLAN.get(i % 20, ("", None))[1]
            key = f"inv-{i:03d}"
            assert (quarantined.get(key) if expected else key in results) == (expected or True), (key, expected)
        # Retries and repairs are rows: 429x2 → 2 each, 500x1 and slowx1 → 1 each, 500x9 and slowx9 → 2 each
        # before their final failed attempt; invalid_once, invalid and negative → 1 repair each.
        assert outcomes["retry"] == 25 * (2 + 1 + 2 + 1 + 2)
        assert outcomes["repair"] == 25 * 3
        assert outcomes["ok"] == len(results)
        assert outcomes["failed"] == len(quarantined)
        # Every answer the provider billed is counted, at the configured prices.
        assert [tokens_in, tokens_out] == server.tokens_served
        assert cost == pytest.approx((tokens_in * PRICE[0] + tokens_out * PRICE[1]) / 1e6)
        provenance = rows(sqlite_url, "SELECT DISTINCT model, system_fingerprint, structured FROM stage_results")
        assert provenance == [("fault-model-2026-01", "fp_fault_1", "json_schema")]
        assert rows(sqlite_url, "SELECT max(attempts) FROM stage_results")[0][0] == 3  # 429x2 took three

        # The provider is fixed: replaying the quarantine turns every item into a result, once.
        server.heal()
        from connectors.sources.dead_letters import DeadLetterSource
        from connectors.store import make_engine

        p, llm = pipeline(sqlite_url, server)
        p.source = DeadLetterSource(make_engine(sqlite_url), "invoices")
        replay = await build_runner(p, SETTINGS, llm=llm, replaying_dead_letters=True).run()
        assert replay.results_written == len(quarantined) and replay.dead_letters == 0
        assert rows(sqlite_url, "SELECT count(*), count(DISTINCT doc_key) FROM stage_results") == [(N, N)]
        assert rows(sqlite_url, "SELECT status, count(*) FROM dead_letters GROUP BY status") == [("replayed", len(quarantined))]
        before = counts(sqlite_url)
        p.source = DeadLetterSource(make_engine(sqlite_url), "invoices")
        again = await build_runner(p, SETTINGS, llm=llm, replaying_dead_letters=True).run()
        await llm.aclose()
        assert again.messages == 0 and counts(sqlite_url) == before  # nothing left: a second replay is a no-op
