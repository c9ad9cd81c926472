"""The pipeline the poison-message test runs with ``etl run``: classify, then extract two numbers.

A test fixture, so it may read its wiring from the environment (the library never does). The model
is a FakeLLM whose answers are valid for every text except four: for those it answers what the
schema lets through (or nearly) but the store cannot hold (NaN, an integer beyond 64 bits, a NUL), so the test can see
that a bad *answer* ends as a dead letter just as a bad *message* does.
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel

from etl import Classify, Extract, KafkaSource, Pipeline
from etl.llm.base import LLMRequest
from etl.testing import FakeLLM, schema_answer

#: Texts whose model answer breaks the store (the test produces these as otherwise good messages).
NAN_CONFIDENCE = "poison answer: a NaN confidence"
HUGE_AMOUNT = "poison answer: an amount beyond 64 bits"
NAN_RATIO = "poison answer: a NaN ratio"
NUL_NOTE = "poison answer: a NUL in a string"


class Amounts(BaseModel):
    """Numbers with no bounds in the schema, so only the store can object to a value."""

    amount: int
    ratio: float
    note: str


def answer(request: LLMRequest) -> str | dict[str, Any]:
    """Poison for the four texts above; a schema-valid answer for any other.

    The document is the first user message (a repair re-ask only appends to the conversation), so a
    repair of a poison answer gets the same poison again and the failure is terminal.
    """
    text = request.messages[1]["content"]
    classify = "enum" in request.json_schema.get("properties", {}).get("label", {})
    if classify and text == NAN_CONFIDENCE:
        return '{"label": "a", "confidence": NaN}'
    if not classify and text == HUGE_AMOUNT:
        return '{"amount": %d, "ratio": 0.5, "note": "n"}' % (2**70)
    if not classify and text == NAN_RATIO:
        return '{"amount": 3, "ratio": NaN, "note": "n"}'
    if not classify and text == NUL_NOTE:
        return '{"amount": 3, "ratio": 0.5, "note": "a\\u0000b"}'
    return schema_answer(request)


# Built only where `etl run` loads this file; the test imports the poison texts above without it.
if "POISON_TOPIC" in os.environ:
    pipeline = Pipeline(
        name="poison",
        source=KafkaSource(os.environ["POISON_TOPIC"], group=f"{os.environ['POISON_TOPIC']}-etl"),
        stages=[Classify(["a", "b"], "Pick a or b.", name="pick"),
                Extract(Amounts, "Extract the amount and the ratio.", name="amounts", table="poison_amounts")],
        llm=FakeLLM(answer, call_log=os.environ["POISON_CALL_LOG"]),
    )
