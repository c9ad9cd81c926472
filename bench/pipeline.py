"""The pipeline benchmark worker processes run (dedup and memory figures). Wiring from the
environment, as a benchmark fixture may; the library never reads it."""

import os

from etl import Classify, KafkaSource, Pipeline
from etl.testing import FakeLLM, lognormal

replay = os.environ.get("BENCH_REPLAY") == "1"
pipeline = Pipeline(
    name="bench",
    source=KafkaSource(os.environ["BENCH_TOPIC"], group=None if replay else "bench-workers",
                       replay_from="start" if replay else None),
    stages=[Classify(["billing", "technical", "account", "other"], "Route the support ticket.", name="route")],
    llm=FakeLLM(latency_s=lognormal(float(os.environ.get("BENCH_LATENCY_S", "0.02")), seed=os.getpid()),
                call_log=os.environ.get("BENCH_CALL_LOG"), price_per_mtok=(0.15, 0.60)),
    review=None,
)
