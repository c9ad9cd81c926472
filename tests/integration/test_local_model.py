"""The real local model (SmolLM2-135M-Instruct via llama.cpp), constrained by outlines.

The constraint test uses labels the model has never seen and no hint in the prompt: left to itself
it answers in prose, so only a constraint that really ran can make every answer valid.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from etl import Classify, Extract, LocalLLM, Pipeline, Receipt, run_pipeline
from etl.llm.base import LLMRequest
from etl.testing import ListSource
from tests.conftest import EXAMPLES
from tests.helpers import counts, rows

pytestmark = pytest.mark.model

MADE_UP = ["zorblax", "quintrel", "vashmoor", "plindle"]
PROMPTS = [
    "My card payment was declined at the shop yesterday.",
    "How do I change my PIN?",
    "The ATM kept my card, what now?",
    "Can I get a refund for a double charge?",
    "Is there a fee for international transfers?",
]


@pytest.fixture(scope="module")
def llm() -> LocalLLM:
    return LocalLLM(n_ctx=2048)


def test_constraint_is_really_applied(llm: LocalLLM) -> None:
    stage = Classify(MADE_UP, "Reply to the customer.")
    unconstrained_valid = constrained_valid = 0
    for text in PROMPTS:
        request = LLMRequest(messages=[{"role": "user", "content": text}], json_schema=stage.llm_schema(), max_tokens=40)
        for constrained in (False, True):
            response = llm.generate_sync(request, constrained=constrained)
            try:
                label = stage.output_model.model_validate_json(response.text).label  # type: ignore[attr-defined]
                valid = label in MADE_UP
            except ValidationError:
                valid = False
            if constrained:
                constrained_valid += valid
                assert response.extra["structured"] == "outlines"
            else:
                unconstrained_valid += valid
    assert constrained_valid == len(PROMPTS)
    assert unconstrained_valid == 0, "the model followed the made-up schema unaided: pick stranger labels"


async def test_real_model_pipeline_outputs_are_schema_valid(llm: LocalLLM, sqlite_url: str) -> None:
    receipts = [json.loads(line) for line in (EXAMPLES / "receipts.jsonl").read_text().splitlines()[:3]]
    intents = json.loads((EXAMPLES / "banking77_categories.json").read_text())
    docs = [{"id": r["id"], "text": r["text"]} for r in receipts]
    p = Pipeline("real", ListSource(docs), [
        Classify(["receipt", "letter", "advert"], "What kind of document is this?", name="kind"),
        Extract(Receipt, "Extract the receipt's key fields.", table="receipt"),
    ], store=sqlite_url)
    stats = await run_pipeline(p, llm=llm)
    assert stats.results_written == stats.stage_runs == 6 and stats.dead_letters == 0, stats
    for stage, output in rows(sqlite_url, "SELECT stage, output FROM stage_results"):
        model = Receipt if stage == "receipt" else p.stages[0].output_model
        model.model_validate_json(output)
    assert rows(sqlite_url, "SELECT count(*) FROM receipt WHERE total >= 0 AND company <> ''")[0][0] == 3
    assert all(r[0] == llm.path.stem for r in rows(sqlite_url, "SELECT model FROM stage_results"))
    before = counts(sqlite_url)
    again = await run_pipeline(Pipeline("real", ListSource(docs), p.stages, store=sqlite_url), llm=llm)
    assert again.llm_calls == 0 and counts(sqlite_url) == before
    assert len(intents) == 77  # the example's label set is intact
