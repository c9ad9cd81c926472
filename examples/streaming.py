"""The banking pipeline as a streaming job: the same stages, reading the topic "banking" in the consumer
group "banking-workers" (the compose file's worker service, `etl run --workers N`, Kubernetes).
Run: etl run examples/streaming.py (with ETL_KAFKA_BOOTSTRAP and ETL_DATABASE_URL set)."""

from pathlib import Path

from etl import KafkaSource, Pipeline
from etl.pipeline import load_pipeline

banking = load_pipeline(str(Path(__file__).with_name("banking.py")))
pipeline = Pipeline(name="banking", source=KafkaSource("banking", group="banking-workers"), stages=banking.stages)
