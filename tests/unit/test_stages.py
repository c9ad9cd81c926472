"""Stages: configuration errors are clear, and every answer is validated whatever the backend did."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from etl import Classify, ConfigError, Extract, Pipeline, SchemaInvalid, Truncated, label_in
from etl.llm.base import LLMResponse
from etl.testing import ListSource


def answer(text: str, finish: str = "stop", confidence: float | None = None) -> LLMResponse:
    return LLMResponse(text=text, model="m", tokens_in=1, tokens_out=1, finish_reason=finish,  # type: ignore[arg-type]
                       confidence=confidence)


def test_classify_accepts_only_its_labels() -> None:
    stage = Classify(["spam", "ham"])
    assert stage.parse(answer('{"label": "ham"}')).label == "ham"  # type: ignore[attr-defined]
    assert stage.parse(answer('{"label": "ham"}', confidence=0.9)).confidence == 0.9  # type: ignore[attr-defined]
    with pytest.raises(SchemaInvalid, match="label"):
        stage.parse(answer('{"label": "eggs"}'))
    with pytest.raises(SchemaInvalid):
        stage.parse(answer("ham, definitely"))
    with pytest.raises(Truncated):
        stage.parse(answer('{"label": "ha', finish="length"))


@pytest.mark.parametrize(
    ("labels", "message"),
    [([], "labels is empty"), (["a", "a", "b"], "duplicate labels"), (["a", ""], "non-empty")],
)
def test_classify_config_errors(labels: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Classify(labels)


class Item(BaseModel):
    name: str
    price: float


def test_extract_validates_against_its_schema() -> None:
    stage = Extract(Item, "Extract the item.")
    assert stage.name == "item" and stage.table == "item"
    assert stage.parse(answer('{"name": "tea", "price": 2.5}')).model_dump() == {"name": "tea", "price": 2.5}
    with pytest.raises(SchemaInvalid, match="price"):
        stage.parse(answer('{"name": "tea", "price": "cheap"}'))
    with pytest.raises(ConfigError, match="pydantic model"):
        Extract(dict, "x")  # type: ignore[arg-type]


def test_unknown_label_in_when_is_a_config_error() -> None:
    source = ListSource([])
    with pytest.raises(ConfigError, match=r"unknown label\(s\) \['spma'\]"):
        Pipeline("p", source, [Classify(["spam", "ham"], name="kind"), Extract(Item, when=label_in("kind", "spma"))])
    with pytest.raises(ConfigError, match="not a Classify stage before it"):
        Pipeline("p", source, [Extract(Item, when=label_in("kind", "spam")), Classify(["spam", "ham"], name="kind")])
    with pytest.raises(ConfigError, match="two stages are named"):
        Pipeline("p", source, [Classify(["a", "b"]), Classify(["a", "b"])])


def test_documents_go_last_in_the_prompt() -> None:
    from etl.testing import schema_answer  # noqa: F401 - the fake must handle every built-in schema
    from schemas import Document, Position

    doc = Document(tenant="t", key="k", content="THE DOC", content_hash="h", position=Position(stream="s", offset=0))
    messages = Classify(["a", "b"], "Pick one.").render(doc)
    assert messages[-1] == {"role": "user", "content": "THE DOC"}
    assert "a, b" in messages[0]["content"]
