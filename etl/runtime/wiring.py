"""Wiring: settings + a pipeline → store, model and runner. What the CLI and tests call."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from connectors.sources.kafka import KafkaSource
from connectors.store import SqlStore
from etl.errors import ConfigError, SourceError
from etl.llm.base import LLM
from etl.metrics import Metrics
from etl.pipeline import Pipeline
from etl.runtime.runner import Runner
from etl.runtime.stats import RunStats
from etl.settings import Settings


def database_url(pipeline: Pipeline | None, settings: Settings) -> str:
    """The pipeline's own store URL if it names one, else the ``ETL_DATABASE_URL`` setting."""
    if pipeline is not None and pipeline.store:
        return pipeline.store
    return settings.database_url.get_secret_value()


def default_llm(settings: Settings) -> LLM:
    """The pipeline's model when it names none: ETL_LLM_BASE_URL's endpoint, else the local model."""
    if settings.llm_base_url:
        from etl.llm.openai_compat import OpenAICompatibleLLM  # noqa: PLC0415

        return OpenAICompatibleLLM(
            settings.llm_base_url, settings.llm_model, api_key=settings.llm_api_key,
            structured=settings.llm_structured, timeout_s=settings.llm_timeout_s,
            requests_per_s=settings.llm_requests_per_s, tokens_per_min=settings.llm_tokens_per_min,
        )
    from etl.llm.local import LocalLLM  # noqa: PLC0415 - loads llama.cpp lazily

    return LocalLLM(settings.model_path, threads=settings.model_threads)


def with_client(source: KafkaSource, settings: Settings) -> KafkaSource:
    """``source`` on the client it names, else the ``ETL_KAFKA_CLIENT`` setting's (a subclass of
    the user's own is left as it is)."""
    from connectors.sources.kafka_confluent import ConfluentKafkaSource  # noqa: PLC0415

    wanted = source.client or settings.kafka_client
    if type(source) not in (KafkaSource, ConfluentKafkaSource) or wanted == source.client_in_use:
        return source
    if wanted == "confluent":
        try:
            import confluent_kafka  # noqa: F401, PLC0415
        except ImportError as exc:
            raise ConfigError("KafkaSource client='confluent' (ETL_KAFKA_CLIENT) needs confluent-kafka: "
                              "pip install 'idem-etl[confluent]'") from exc
    return source.like(ConfluentKafkaSource if wanted == "confluent" else KafkaSource)


def priced(llm: LLM, settings: Settings) -> LLM:
    """``llm`` with its price from ``ETL_PRICES`` when it was given none."""
    if llm.price_per_mtok == (0.0, 0.0) and llm.model_id in settings.prices:
        llm.price_per_mtok = settings.prices[llm.model_id]
    return llm


def build_runner(pipeline: Pipeline, settings: Settings | None = None, *, llm: LLM | None = None,
                 store_url: str | None = None, idle_stop_s: float | None = None,
                 on_progress: Callable[[RunStats], None] | None = None, metrics: Metrics | None = None,
                 replaying_dead_letters: bool = False, batch: bool = False) -> Runner:
    """``batch``: model calls go through the provider's Batch API (see ``etl.llm.batch``), with a
    window of ``ETL_BATCH_WINDOW`` documents in flight, so one batch carries many of them."""
    settings = settings or Settings()
    store = SqlStore(store_url or database_url(pipeline, settings))
    source = pipeline.source
    if isinstance(source, KafkaSource):
        pipeline.source = source = with_client(source, settings)
        source.bootstrap = source.bootstrap or settings.kafka_bootstrap
        source.consumer_config.setdefault("session_timeout_ms", settings.kafka_session_timeout_ms)
        source.consumer_config.setdefault("heartbeat_interval_ms", settings.kafka_session_timeout_ms // 4)
    llm = priced(llm or pipeline.llm or default_llm(settings), settings)
    if batch:
        llm = _batching(pipeline, llm, store, settings)
        settings = settings.model_copy(update={"max_in_flight": max(settings.max_in_flight, settings.batch_window)})
    return Runner(pipeline, store, llm, settings, idle_stop_s=idle_stop_s, on_progress=on_progress, metrics=metrics,
                  replaying_dead_letters=replaying_dead_letters)


def _batching(pipeline: Pipeline, llm: LLM, store: SqlStore, settings: Settings) -> LLM:
    from connectors.store.batches import BatchLedger  # noqa: PLC0415
    from etl.llm.batch import BatchLLM  # noqa: PLC0415
    from etl.llm.anthropic import AnthropicLLM  # noqa: PLC0415
    from etl.llm.openai_compat import OpenAICompatibleLLM  # noqa: PLC0415

    if not isinstance(llm, (OpenAICompatibleLLM, AnthropicLLM)):
        raise ConfigError(f"--batch needs an OpenAI-compatible or Anthropic model (ETL_LLM_BASE_URL or Pipeline(llm=...)); "
                          f"{type(llm).__name__} has no batch API")
    if isinstance(pipeline.source, KafkaSource) and pipeline.source.replay_from is None:
        pipeline.source.until_end = True  # a backfill of what the topic holds when the run starts
    return BatchLLM(llm, BatchLedger(store.engine, pipeline.name, llm.base_url), discount=settings.batch_discount,
                    poll_s=settings.batch_poll_s, sends=settings.llm_max_attempts)


def replay_source(pipeline: Pipeline, since: datetime | None) -> KafkaSource:
    """A one-off reader of the pipeline's topic from offset 0 (or a time) to its current end."""
    source = pipeline.source
    if not isinstance(source, KafkaSource):
        raise ConfigError(f"pipeline {pipeline.name!r} reads {type(source).__name__}, not Kafka: "
                          "file sources are re-read by every `etl run` already")
    return source.like(group=None, replay_from=since or "start", until_end=False)


async def run_pipeline(pipeline: Pipeline, settings: Settings | None = None, **kwargs: object) -> RunStats:
    """Runs ``pipeline`` to the end of its source and returns the counts."""
    runner = build_runner(pipeline, settings, **kwargs)  # type: ignore[arg-type]
    try:
        return await runner.run()
    finally:
        await runner.llm.aclose()


def topic_end_offsets(pipeline: Pipeline, settings: Settings) -> dict[tuple[str, int], int] | None:
    """End offsets of a Kafka pipeline's topic (for lag), or None for other sources."""
    source = pipeline.source
    if not isinstance(source, KafkaSource):
        return None
    probe = with_client(replay_source(pipeline, None), settings)
    probe.bootstrap = source.bootstrap or settings.kafka_bootstrap
    try:
        probe.open(None)  # type: ignore[arg-type]  # a replay reader never calls its ledger
        return dict(probe.replay_end or {})
    except RuntimeError as exc:
        raise SourceError(str(exc)) from exc
    finally:
        probe.close()
