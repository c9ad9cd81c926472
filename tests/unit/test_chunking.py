"""Chunk boundaries (etl.stages.chunking): chunks cover the document, fit the model's count of
tokens whatever its tokenizer, and an edit re-keys only the chunks near it."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from etl.stages.chunking import chunk, estimate_tokens

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


@given(paragraphs=st.lists(st.lists(words, min_size=3, max_size=30).map(" ".join), min_size=20, max_size=60),
       counter=st.sampled_from(sorted(COUNTERS)), where=st.floats(0, 1), edit=words)
@settings(max_examples=100, deadline=None)
def test_an_edited_paragraph_re_keys_only_the_chunks_near_it(paragraphs: list[str], counter: str, where: float,
                                                             edit: str) -> None:
    count = COUNTERS[counter]
    before = chunk("\n\n".join(paragraphs), 128, 0, count)
    at = int(where * (len(paragraphs) - 1))
    edited = [*paragraphs[:at], paragraphs[at] + " " + edit, *paragraphs[at + 1:]]
    after = chunk("\n\n".join(edited), 128, 0, count)
    new = [p for p in after if p.text not in {q.text for q in before}]
    assert len(new) <= 3, (len(before), len(after), len(new))
