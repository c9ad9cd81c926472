"""The pipeline the lease test's two worker processes run with ``etl run``: one JSONL file read by
both, a slow model (LEASE_LATENCY_S, longer than the lease) that refuses tickets marked "refuse",
every call logged to one file.

A test fixture, so it may read its wiring from the environment (the library never does).
"""

import os

from etl import Classify, JsonlSource, Pipeline
from etl.testing import FakeLLM, schema_answer


def answer(request):  # tickets marked "refuse" are refused: a terminal failure for the key
    return "I'm sorry, I can't help with that." if "refuse" in request.messages[1]["content"] else schema_answer(request)


pipeline = Pipeline(
    name="leases",
    source=JsonlSource(os.environ["LEASE_INPUT"]),
    stages=[Classify(["billing", "technical", "other"], "Route the ticket.", name="route")],
    llm=FakeLLM(answer, latency_s=float(os.environ["LEASE_LATENCY_S"]), call_log=os.environ["LEASE_CALL_LOG"]),
)
