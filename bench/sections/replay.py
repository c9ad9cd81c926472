"""Replay: 100,000 processed messages read again, idem-etl ÷ raw kafka-python."""

from __future__ import annotations

from etl.testing import FakeLLM

from bench.common import (
    Figure, REPLAY_IN_FLIGHT, RUNS, fresh_schema, log, new_topic, produce, run_idem, run_raw, summary, tickets,
)


def replay_figures(n: int = 100_000) -> list[Figure]:
    topic = new_topic()
    log(f"replay: producing {n:,} messages and processing them once")
    produce(topic, tickets(n))
    url = fresh_schema()
    run_idem(topic, url, FakeLLM(), in_flight=REPLAY_IN_FLIGHT)  # process everything once
    ratios, idem_rates, raw_rates = [], [], []
    for r in range(RUNS):
        llm = FakeLLM()
        if r % 2:  # alternate the order, so neither side always runs on a warmer broker
            idem_n, idem_s, _ = run_idem(topic, url, llm, in_flight=REPLAY_IN_FLIGHT)
            raw_n, raw_s = run_raw(topic)
        else:
            raw_n, raw_s = run_raw(topic)
            idem_n, idem_s, _ = run_idem(topic, url, llm, in_flight=REPLAY_IN_FLIGHT)
        assert raw_n == idem_n == n and not llm.calls, (raw_n, idem_n, len(llm.calls))
        raw_rates.append(raw_n / raw_s)
        idem_rates.append(idem_n / idem_s)
        ratios.append(idem_rates[-1] / raw_rates[-1])
        log(f"replay run {r}: raw {raw_rates[-1]:.0f}/s idem {idem_rates[-1]:.0f}/s ratio {ratios[-1]:.3f}")
    return [
        summary(f"replay of {n:,} processed messages: idem-etl ÷ raw kafka-python", ratios, "≥ 0.8",
                met=lambda v: v >= 0.8,
                note=f"both timed from creating their consumer to the last message; idem-etl with "
                     f"ETL_MAX_IN_FLIGHT={REPLAY_IN_FLIGHT} (see bench/NOTES.md)"),
        summary("  raw kafka-python consume + JSON decode", raw_rates, "baseline", "msgs/s"),
        summary("  idem-etl replay (Kafka → PostgreSQL look-up, 0 LLM calls)", idem_rates, "", "msgs/s"),
    ]
