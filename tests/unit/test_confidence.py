"""Per-field confidence from token log-probabilities (etl.confidence), against a reference that
writes the JSON itself and so knows where every value is; calibration's arithmetic."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from etl.confidence import calibration, from_logprobs, value_ranges

scalars = st.one_of(st.text(max_size=8), st.integers(-10**6, 10**6), st.floats(-1e6, 1e6, allow_nan=False),
                    st.booleans(), st.none())
documents = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=10)


def write(value: Any, path: str, out: list[str], spans: dict[str, tuple[int, int]], space: str) -> None:
    """JSON text of ``value`` into ``out``, recording each scalar's (start, end) under its path."""
    at = sum(map(len, out))
    if isinstance(value, dict):
        out.append("{" + space)
        for number, (key, item) in enumerate(value.items()):
            out.append(("," + space if number else "") + json.dumps(key) + ":" + space)
            write(item, f"{path}.{key}" if path else key, out, spans, space)
        out.append(space + "}")
    elif isinstance(value, list):
        out.append("[")
        for number, item in enumerate(value):
            out.append("," + space if number else "")
            write(item, f"{path}[{number}]", out, spans, space)
        out.append("]")
    else:
        text = json.dumps(value)
        out.append(text)
        spans[path] = (at, at + len(text))


@given(document=st.dictionaries(st.text(max_size=5), documents, min_size=1, max_size=4),
       cuts=st.lists(st.integers(0, 400), max_size=40), seed=st.integers(0, 10**6), space=st.sampled_from(["", " ", "\n  "]))
@settings(max_examples=300, deadline=None)
def test_each_value_gets_the_product_of_the_tokens_that_spell_it(document: dict[str, Any], cuts: list[int],
                                                                  seed: int, space: str) -> None:
    out: list[str] = []
    spans: dict[str, tuple[int, int]] = {}
    write(document, "", out, spans, space)
    text = "".join(out)
    if len({*spans}) != len(spans) or any("." in k or "[" in k for k in _keys(document)):
        return  # keys that look like paths name two values alike: not what a schema's fields do
    assert value_ranges(text) == spans
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    tokens = [(text[a:b], -((seed * (i + 1)) % 97) / 50) for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
    got = from_logprobs(text, tokens)
    assert set(got) == set(spans)
    for path, (start, end) in spans.items():
        if text[start] == '"' and end - start > 2:  # a string: the characters inside its quotes
            start, end = start + 1, end - 1
        covering, at = 0.0, 0
        for piece, logprob in tokens:
            if at < end and at + len(piece) > start:
                covering += logprob
            at += len(piece)
        assert math.isclose(got[path][0], math.exp(covering), rel_tol=1e-9) and got[path][1] == "logprob"


def _keys(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [*value, *(k for v in value.values() for k in _keys(v))]
    if isinstance(value, list):
        return [k for v in value for k in _keys(v)]
    return []


def test_pieces_that_do_not_spell_the_answer_claim_nothing() -> None:
    text = '{"total": 12.5}'
    assert from_logprobs(text, [("{\"tot", -0.1), ("al\": 99}", -0.1)]) == {}
    assert from_logprobs(text, [(text, float("nan"))]) == {}
    assert from_logprobs(text, ()) == {}
    assert from_logprobs("prose, not JSON", [("prose, not JSON", 0.0)]) == {}
    # a server that strips the leading space of the first token still lines up
    assert from_logprobs(text, [(" {", 0.0), ('"total": ', 0.0), ("12.5", math.log(0.25)), ("}", 0.0)]) == {
        "total": [0.25, "logprob"]}
    # the last token unreported: the value it would end gets no confidence, the others keep theirs
    two = '{"a": "x", "b": 7}'
    assert from_logprobs(two, [('{"a": ', 0.0), ('"x"', math.log(0.5)), (', "b": ', 0.0)]) == {
        "a": [0.5, "logprob"]}


def test_calibration_is_the_weighted_gap_between_confidence_and_accuracy() -> None:
    pairs = [(0.95, True)] * 9 + [(0.95, False)] + [(0.25, True)] + [(0.25, False)] * 3
    result = calibration(pairs)
    # bin 0.9-1.0: 10 values, confidence 0.95, accuracy 0.9; bin 0.2-0.3: 4 values, 0.25 vs 0.25
    assert result["ece"] == round(10 / 14 * 0.05, 4) and result["pairs"] == 14
    assert [b["count"] for b in result["bins"]] == [0, 0, 4, 0, 0, 0, 0, 0, 0, 10]
    assert calibration([(1.0, True)])["bins"][-1]["count"] == 1  # 1.0 falls in the last bin
    assert calibration([])["ece"] is None
    assert calibration([(float("nan"), True), (0.5, True)])["pairs"] == 1


def test_openai_pieces_come_from_bytes_so_a_character_split_across_tokens_keeps_its_confidence() -> None:
    """Found in review: OpenAI spells a token that ends inside a UTF-8 character as a fragment
    (``bytes:\\xe6\\x9d``), so the token strings do not spell the answer and every value of a
    non-ASCII answer lost its confidence. Each item's ``bytes`` do spell it."""
    from etl.llm.openai_compat import _token_logprobs

    text = '{"company": "東京 SHOP", "total": 3}'
    raw = text.encode()
    split = raw.index("東".encode()) + 1  # one byte into the three of 東
    cuts = [0, split - 1, split, split + 4, len(raw) - 3, len(raw)]
    items = []
    for a, b in zip(cuts, cuts[1:]):
        piece = raw[a:b]
        try:
            token = piece.decode()
        except UnicodeDecodeError:
            token = "bytes:" + "".join(f"\\x{byte:02x}" for byte in piece)
        # the token that begins 東 and the one that completes it: both are the value's
        items.append({"token": token, "logprob": math.log(0.5) if a in (split - 1, split) else 0.0, "bytes": list(piece)})
    choice = {"logprobs": {"content": items}}
    pieces = _token_logprobs(choice)
    assert "".join(p for p, _ in pieces) == text
    assert from_logprobs(text, pieces) == {"company": [0.25, "logprob"], "total": [1.0, "logprob"]}
    # without bytes the fragments do not spell the answer: nothing is claimed, nothing is wrong
    for item in items:
        del item["bytes"]
    assert from_logprobs(text, _token_logprobs(choice)) == {}


def test_a_log_probability_that_is_not_a_finite_number_claims_nothing() -> None:
    text = '{"total": 12.5}'
    assert from_logprobs(text, [(text, float("inf"))]) == {}
    assert from_logprobs(text, [(text, float("-inf"))]) == {}
    assert from_logprobs(text, [(text, 0.3)]) == {"total": [1.0, "logprob"]}  # above 0 is read as certain


def test_a_fenced_answer_s_values_get_their_confidence() -> None:
    text = '```json\n{"total": 12.5}\n```'
    assert from_logprobs(text, [("```json\n{", 0.0), ('"total": ', 0.0), ("12.5", math.log(0.25)), ("}\n```", 0.0)]) == {
        "total": [0.25, "logprob"]}


def test_only_values_the_validated_answer_holds_unchanged_keep_a_confidence() -> None:
    text = '{"a": "x ", "b": 12.50, "c": "7", "gone\\u0000": 1}'
    tokens = [(text, math.log(0.5))]
    assert set(from_logprobs(text, tokens)) == {"a", "b", "c", "gone\x00"}
    assert set(from_logprobs(text, tokens, {"a": "x", "b": "12.5", "c": 7})) == {"a", "b", "c"}
    assert set(from_logprobs(text, tokens, {"a": "y", "b": 12.6, "c": "8"})) == set()


def test_booleans_and_nulls_keep_the_confidence_of_the_tokens_that_chose_them() -> None:
    text = '{"paid": true, "note": null, "flag": false}'
    tokens = [('{"paid": ', 0.0), ("true", math.log(0.6)), (', "note": ', 0.0), ("null", math.log(0.3)),
              (', "flag": ', 0.0), ("false", math.log(0.9)), ("}", 0.0)]
    got = from_logprobs(text, tokens, {"paid": True, "note": None, "flag": False})
    assert {path: round(p, 9) for path, (p, _) in got.items()} == {"paid": 0.6, "note": 0.3, "flag": 0.9}
    # a validator that turned a boolean into 1, or filled a null, changed what the model chose
    assert from_logprobs(text, tokens, {"paid": 1, "note": "x", "flag": False}).keys() == {"flag"}


def test_a_list_sorted_by_one_field_moves_its_items_other_fields_confidence_away() -> None:
    # found by review: equal totals looked unchanged, so B's sure total was handed to A
    text = '{"receipts": [{"company": "B", "total": 1.0}, {"company": "A", "total": 1.0}, {"company": "C", "total": 2}]}'
    tokens = [(text, math.log(0.5))]
    validated = {"receipts": [{"company": "A", "total": 1.0}, {"company": "B", "total": 1.0},
                              {"company": "C", "total": 2}]}
    assert set(from_logprobs(text, tokens, validated)) == {"receipts[2].company", "receipts[2].total"}
    extra = '{"receipts": [{"company": "B", "note": "dropped by the schema"}]}'  # an unkept key moves nothing
    assert set(from_logprobs(extra, [(extra, 0.0)], {"receipts": [{"company": "B"}]})) == {"receipts[0].company"}


def test_a_repeated_key_s_overwritten_value_claims_nothing() -> None:
    # found by review: {"a": {"x", "y"}, "a": {"x"}} gave a schema-filled a.y the first a.y's confidence
    text = '{"a": {"x": 1, "y": 2}, "a": {"x": 3}}'
    assert value_ranges(text).keys() == {"a.x"}
    assert set(from_logprobs(text, [(text, 0.0)], {"a": {"x": 3, "y": 2}})) == {"a.x"}


def test_an_answer_with_prose_after_its_json_gets_its_confidence() -> None:
    text = '{"total": 12.5} Let me know if you need anything else.'
    assert set(from_logprobs(text, [(text, math.log(0.9))], {"total": 12.5})) == {"total"}


def test_an_answer_nested_past_the_stack_claims_nothing_rather_than_raising() -> None:
    text = '{"extra": ' + "[" * 5000 + "1" + "]" * 5000 + "}"
    assert from_logprobs(text, [(text, 0.0)]) == {}
    assert value_ranges(text) == {}


def test_an_object_nested_in_a_broken_one_is_never_taken_for_the_answer() -> None:
    # found by review: with prose before it, an outer object Python will not read (5,000 digits) or
    # a truncated one made the scan take the inner object: coffee at 99 for an answer of tea at 2.5
    from etl.confidence import embedded_object

    inner = '{"name": "coffee", "price": 99.0}'
    assert embedded_object('Sure: {"name": "tea", "price": ' + "2" * 5000 + ', "alt": ' + inner + "}") is None
    assert embedded_object('Sure: {"name": "tea", "price": 2.5, "alt": ' + inner) is None  # truncated
    assert embedded_object("Use {name} as the key: " + inner)[0] == {"name": "coffee", "price": 99.0}  # type: ignore[index]
