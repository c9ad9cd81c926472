"""Keys: stable across processes; changed by exactly prompt, schema, model, parameters, tenant, content."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import BaseModel

from dedup import cache_key, canonical_json, content_hash, normalize_content
from etl import Classify, Extract
from etl.runtime.execute import StagePlan
from etl.testing import FakeLLM
from schemas import Document, Position


class Invoice(BaseModel):
    number: str
    total: float


def doc(content: str = "Total: 12.50 EUR", tenant: str = "acme", key: str = "d1", offset: int = 0) -> Document:
    return Document(tenant=tenant, key=key, content=content, content_hash=content_hash(content),
                    position=Position(stream="s", offset=offset))


def key_of(stage: object = None, llm: FakeLLM | None = None, document: Document | None = None) -> str:
    stage = stage or Extract(Invoice, "Extract the invoice.")
    return StagePlan.of(stage, llm or FakeLLM()).key(document or doc())  # type: ignore[arg-type]


BASE = key_of()


def test_same_inputs_same_key_in_another_process() -> None:
    # A fresh interpreter with another hash seed: Python's hash() would differ, our keys must not.
    code = "from tests.unit.test_hashing import key_of; print(key_of())"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": "12345"}, cwd=Path(__file__).parents[2])
    assert result.stdout.strip() == BASE


class Invoice2(BaseModel):
    number: str
    total: float
    currency: str


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param(lambda: key_of(stage=Extract(Invoice, "Extract the invoice fields.")), id="prompt"),
        pytest.param(lambda: key_of(stage=Extract(Invoice2, "Extract the invoice.", name="invoice")), id="schema"),
        pytest.param(lambda: key_of(llm=FakeLLM(model_id="other-model")), id="model"),
        pytest.param(lambda: key_of(stage=Extract(Invoice, "Extract the invoice.", max_tokens=300)), id="max-tokens"),
        pytest.param(lambda: key_of(llm=_with_params({"temperature": 0.7})), id="parameters"),
        pytest.param(lambda: key_of(document=doc(tenant="globex")), id="tenant"),
        pytest.param(lambda: key_of(document=doc(content="Total: 12.51 EUR")), id="content"),
    ],
)
def test_each_input_changes_the_key(changed: object) -> None:
    assert changed() != BASE  # type: ignore[operator]


def _with_params(params: dict[str, object]) -> FakeLLM:
    llm = FakeLLM()
    llm.params = params
    return llm


@pytest.mark.parametrize(
    "same",
    [
        pytest.param(lambda: key_of(document=doc(key="another-key")), id="doc-key"),
        pytest.param(lambda: key_of(document=doc(offset=99)), id="position"),
        pytest.param(lambda: key_of(stage=Extract(Invoice, "Extract the invoice.", when=lambda o: True)), id="when"),
        pytest.param(lambda: key_of(stage=Extract(Invoice, "Extract the invoice.", table="invoices")), id="table"),
        pytest.param(lambda: key_of(stage=Extract(Invoice, "  Extract the invoice.\n")), id="outer-whitespace"),
        pytest.param(lambda: key_of(document=doc(content="Total: 12.50 EUR").model_copy(
            update={"received_at": datetime(2001, 1, 1, tzinfo=timezone.utc)})), id="received-at"),
        pytest.param(lambda: key_of(llm=FakeLLM(latency_s=0.5)), id="latency"),
    ],
)
def test_nothing_else_changes_the_key(same: object) -> None:
    assert same() == BASE  # type: ignore[operator]


def test_classify_labels_change_the_key() -> None:
    a = key_of(stage=Classify(["invoice", "receipt"]))
    assert key_of(stage=Classify(["invoice", "receipt"])) == a
    assert key_of(stage=Classify(["invoice", "receipt", "other"])) != a


def test_normalization_folds_line_endings_and_unicode_forms() -> None:
    assert content_hash("a\r\nb") == content_hash("a\nb") == content_hash("a\rb")
    assert content_hash("caf\u00e9") == content_hash("cafe\u0301")
    assert content_hash("a b") != content_hash("a  b")  # whitespace is content
    assert content_hash("A") != content_hash("a")
    assert normalize_content("cafe\u0301\r\n") == "caf\u00e9\n"


def test_canonical_json_ignores_key_order_and_rejects_nan() -> None:
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": 3}]}) == canonical_json({"a": [1, {"c": 3, "d": 2}], "b": 1})
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


@pytest.mark.parametrize("tenant", ["acme", 'qu"ote\\', "tab\tnew\nline\x00", "Zürich 東京 🙂", ""])
def test_cache_key_is_the_hash_of_canonical_json(tenant: str) -> None:
    """The written-out fast form must stay byte-identical to the documented definition, or every
    stored key would silently stop matching."""
    fields = {"tenant": tenant, "fingerprint": "f" * 64, "content": "c" * 64}
    assert cache_key(tenant, "f" * 64, "c" * 64) == hashlib.sha256(canonical_json(fields).encode()).hexdigest()


def test_cache_key_separates_tenants() -> None:
    assert cache_key("acme", "f", "c") != cache_key("globex", "f", "c")
    assert cache_key("acme", "f", "c") == cache_key("acme", "f", "c")
