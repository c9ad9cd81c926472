"""Chunk boundaries (etl.stages.chunking): chunks cover the document, fit the model's count of
tokens whatever its tokenizer, and an edit re-keys only the chunks near it."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from dedup import SingleFlight, content_hash
from etl import Extract
from etl.llm.base import LLM, LLMRequest, LLMResponse
from etl.runtime.calls import ModelCalls, StageFailed
from etl.runtime.chunks import answer_in_chunks
from etl.stages import StagePlan
from etl.stages.chunking import Chunking, chunk, estimate_tokens
from schemas import Document, Position

#: Counters standing in for tokenizers that read fewer characters a token than the estimate
#: (SmolLM2 reads receipts at about 1.6): the chunks must fit the count the model makes.
COUNTERS: dict[str, Callable[[str], int]] = {
    "estimate": estimate_tokens,
    "a character a token": len,
    "two characters a token": lambda text: -(-len(text) // 2),
    "a word a token": lambda text: len(text.split()) + text.count("\n"),
}

words = st.text(alphabet="abcdefghij0123456789", min_size=1, max_size=12)
paragraphs = st.lists(st.lists(words, min_size=1, max_size=30).map(" ".join), min_size=1, max_size=60)


@given(paragraphs=paragraphs, counter=st.sampled_from(sorted(COUNTERS)), max_tokens=st.sampled_from([64, 100, 256]),
       long_line=st.integers(0, 3000))
@settings(max_examples=200, deadline=None)
def test_chunks_cover_the_text_and_each_fits_the_model_s_count(paragraphs: list[str], counter: str, max_tokens: int,
                                                               long_line: int) -> None:
    count = COUNTERS[counter]
    text = "\n\n".join(paragraphs) + "\n\n" + "x" * long_line  # and one unbreakable line
    parts = chunk(text, max_tokens, 0, count)
    assert "".join(p.text for p in parts) == text
    assert all(text[p.start:p.end] == p.text for p in parts)
    assert all(count(p.text) <= max_tokens for p in parts), [count(p.text) for p in parts]


@pytest.mark.parametrize("counter", sorted(COUNTERS))
def test_an_edited_paragraph_re_keys_only_the_chunks_near_it(counter: str) -> None:
    # Locality is a property of the distribution, not of every text: a paragraph repeated many
    # times gives no boundary a reason to stay put (Hypothesis found "0 0 0" x 40 re-keying every
    # chunk after the edit, as it would in any content-defined chunking), and even random text
    # lets an edit move a few size-forced boundaries now and then. So: 250 seeded random
    # documents of 20-60 paragraphs per counter, one paragraph edited in each, and the figures
    # measured on 2026-12-07 with a margin: at most 3 new chunks in >= 97% of edits (98.4-100%
    # measured), 1.5 on average (1.06-1.29). Without content-defined ends (every cut forced by
    # size) 4% of the estimate's edits re-key 5 to 7 chunks and fail this; the other counters'
    # pieces are uneven enough at 128 tokens that forced cuts fall back into step by themselves.
    count, rng = COUNTERS[counter], random.Random(f"chunking-{counter}")
    alphabet = "abcdefghij0123456789"

    def word() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 12)))

    new = []
    for _ in range(250):
        paragraphs = [" ".join(word() for _ in range(rng.randint(3, 30))) for _ in range(rng.randint(20, 60))]
        before = {p.text for p in chunk("\n\n".join(paragraphs), 128, 0, count)}
        at = rng.randrange(len(paragraphs))
        edited = [*paragraphs[:at], paragraphs[at] + " " + word(), *paragraphs[at + 1:]]
        new.append(sum(p.text not in before for p in chunk("\n\n".join(edited), 128, 0, count)))
    assert sum(n <= 3 for n in new) / len(new) >= 0.97, sorted(new)[-10:]
    assert sum(new) / len(new) <= 1.5, sum(new) / len(new)


class _Dense(LLM):
    """A model that reads a character a token (denser than the estimate) in a 2,048-token context."""

    model_id, params, context_tokens = "dense", {}, 2048

    def token_counter(self) -> Callable[[str], int]:
        return len

    async def generate(self, request: LLMRequest) -> LLMResponse:
        digest = hashlib.sha256(request.messages[-1]["content"].encode()).hexdigest()
        return LLMResponse(text=json.dumps({"items": [digest[:6], digest[6:12]]}), model="dense", tokens_in=1,
                           tokens_out=1)


def test_a_chunk_and_its_re_ask_fit_the_context_whatever_the_user_template() -> None:
    # found by review: the budget left out the user template and the re-ask's repeated answer, so a
    # chunk that filled its budget overflowed the context on a repair (or at once, with a template)
    class Items(BaseModel):
        items: list[str]

    class Templated(Extract):
        def user_template(self) -> str:
            return "Read this carefully, line by line, and answer in JSON.\n" * 10 + "{content}"

    for stage in (Extract(Items, "Extract the items.", chunking=Chunking()),
                  Templated(Items, "Extract the items.", chunking=Chunking())):
        llm = _Dense()
        plan = StagePlan.of(stage, llm)
        text = "\n\n".join(f"item {n}: " + "x" * 300 for n in range(40))
        biggest = max(plan.chunks(text), key=lambda p: len(p.text))
        document = Document(tenant="t", key="k", content=biggest.text, content_hash="h",
                            position=Position(stream="s", offset=0))
        request = LLMRequest(messages=stage.render(document), json_schema=None, max_tokens=stage.max_tokens)
        repaired = stage.repair(request, "x" * stage.max_tokens, "a problem of about a line, said to the model")
        used = sum(len(m["content"]) for m in repaired.messages) + stage.max_tokens
        assert used <= llm.context_tokens, (type(stage).__name__, used)


def test_a_long_document_s_merged_answer_meets_the_stage_s_validators() -> None:
    # found by review: each chunk's answer was validated, the document's merged one only by the schema
    class Items(BaseModel):
        items: list[str]

    def at_most_two(output: Items) -> str | None:
        return None if len(output.items) <= 2 else f"{len(output.items)} items: at most 2"

    stage = Extract(Items, "Extract the items.", chunking=Chunking(max_tokens=64), validators=[at_most_two])
    plan = StagePlan.of(stage, _Dense())
    text = "".join(f"paragraph {n} " + "word " * 60 + "\n\n" for n in range(4))
    document = Document(tenant="t", key="k", content=text, content_hash=content_hash(text),
                        position=Position(stream="s", offset=0))
    parts = plan.chunks(text)
    try:
        asyncio.run(answer_in_chunks(SingleFlight(), ModelCalls(), plan, document, plan.key(document), parts))
    except StageFailed as failed:
        assert failed.reason == "semantic_invalid" and "at most 2" in str(failed)
        assert len(failed.cache) == len({p.text for p in parts})  # each distinct chunk stays paid for and cached
    else:
        raise AssertionError("a merged answer of more than two items passed a validator allowing two")
