"""The pipeline the chaos test's worker processes run with ``etl run``.

A test fixture, so it may read its wiring from the environment (the library never does).
"""

import os

from etl import Classify, KafkaSource, Pipeline
from etl.testing import FakeLLM, lognormal

pipeline = Pipeline(
    name="reliability",
    source=KafkaSource(os.environ["RELIABILITY_TOPIC"], group="reliability-workers"),
    stages=[Classify(["billing", "technical", "account", "other"], "Route the support ticket.", name="route")],
    llm=FakeLLM(latency_s=lognormal(float(os.environ.get("RELIABILITY_LATENCY_S", "0.05")), seed=os.getpid()),
                call_log=os.environ["RELIABILITY_CALL_LOG"]),
)
