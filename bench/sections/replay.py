"""Replay: 100,000 processed messages read again, idem-etl ÷ raw kafka-python (and both on confluent-kafka)."""

from __future__ import annotations

from etl.testing import FakeLLM

from bench.common import (
    Figure, REPLAY_IN_FLIGHT, RUNS, fresh_schema, log, new_topic, produce, run_idem, run_raw, run_raw_confluent,
    summary, tickets,
)


def replay_figures(n: int = 100_000) -> list[Figure]:
    topic = new_topic()
    log(f"replay: producing {n:,} messages and processing them once")
    produce(topic, tickets(n))
    url = fresh_schema()
    run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)  # process everything once
    rates: dict[str, list[float]] = {"raw": [], "raw_confluent": [], "idem": [], "idem_confluent": []}
    for r in range(RUNS):
        llm = FakeLLM()
        runs = [("raw", lambda: run_raw(topic)), ("raw_confluent", lambda: run_raw_confluent(topic)),
                ("idem", lambda: run_idem(topic, url, llm, in_flight=REPLAY_IN_FLIGHT)[:2]),
                ("idem_confluent", lambda: run_idem(topic, url, llm, in_flight=REPLAY_IN_FLIGHT, client="confluent")[:2])]
        for name, run in runs[r % len(runs):] + runs[:r % len(runs)]:  # rotate the order: no side always warmer
            count, seconds = run()
            assert count == n, (name, count)
            rates[name].append(count / seconds)
        assert not llm.calls, len(llm.calls)
        log(f"replay run {r}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rates.items()))
    ratio = lambda a, b: [x / y for x, y in zip(rates[a], rates[b], strict=True)]  # noqa: E731
    note = (f"both timed from creating their consumer to the last message; idem-etl with "
            f"ETL_MAX_IN_FLIGHT={REPLAY_IN_FLIGHT} (see bench/NOTES.md)")
    return [
        summary(f"replay of {n:,} processed messages: idem-etl ÷ raw kafka-python", ratio("idem", "raw"), "≥ 0.8",
                met=lambda v: v >= 0.8, note=note),
        summary(f"replay of {n:,} processed messages: idem-etl on confluent-kafka (ETL_KAFKA_CLIENT=confluent) "
                "÷ raw kafka-python", ratio("idem_confluent", "raw"), "≥ 0.8", met=lambda v: v >= 0.8,
                note="the best configuration a user can pick by settings for a replay (a replay is one reader "
                     "outside the group: --workers does not split it)"),
        summary(f"replay of {n:,} processed messages: idem-etl on confluent-kafka ÷ raw confluent-kafka",
                ratio("idem_confluent", "raw_confluent"), "report"),
        summary("  raw kafka-python consume + JSON decode", rates["raw"], "baseline", "msgs/s"),
        summary("  raw confluent-kafka consume + JSON decode", rates["raw_confluent"], "baseline", "msgs/s"),
        summary("  idem-etl replay (Kafka → PostgreSQL look-up, 0 LLM calls)", rates["idem"], "", "msgs/s"),
        summary("  idem-etl replay on confluent-kafka", rates["idem_confluent"], "", "msgs/s"),
    ]
