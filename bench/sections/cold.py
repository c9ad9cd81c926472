"""The cold path: new documents against a model with lognormal latency, ÷ the ideal at each concurrency."""

from __future__ import annotations

from etl.testing import FakeLLM, lognormal

from bench.common import (
    Figure, MEAN_S, MEDIAN_S, RUNS, SIGMA, fresh_schema, log, new_topic, produce, run_idem, run_naive,
    steady_rate, summary, tickets,
)


def cold_figures() -> list[Figure]:
    out = []
    for concurrency in (1, 8, 64, 256):
        n = max(30, int(6.0 * concurrency / MEAN_S))  # about 6 s of ideal work per run
        ideal = concurrency / MEAN_S
        vs_ideal, end_to_end, vs_naive, rates = [], [], [], []
        for r in range(RUNS):
            topic = new_topic()
            produce(topic, tickets(n, seed=1000 * concurrency + r))
            idem_n, idem_s, idem_marks = run_idem(
                topic, fresh_schema(), FakeLLM(latency_s=lognormal(MEDIAN_S, SIGMA, seed=r)), in_flight=concurrency)
            naive_n, _, naive_marks = run_naive(
                topic, fresh_schema(), FakeLLM(latency_s=lognormal(MEDIAN_S, SIGMA, seed=r)), concurrency)
            assert idem_n == naive_n == n
            rates.append(steady_rate(idem_marks, n))
            vs_ideal.append(rates[-1] / ideal)
            end_to_end.append(idem_n / idem_s / ideal)
            vs_naive.append(rates[-1] / steady_rate(naive_marks, n))
            log(f"cold c={concurrency} run {r}: steady {rates[-1]:.1f}/s (end to end {idem_n / idem_s:.1f}/s) "
                f"ideal {ideal:.1f}/s naive {steady_rate(naive_marks, n):.1f}/s")
        goal = "≥ 0.9" if concurrency in (64, 256) else ""
        out.append(summary(f"cold path, concurrency {concurrency} ({n} msgs): idem-etl ÷ ideal", vs_ideal, goal,
                           met=(lambda v: v >= 0.9) if goal else None,
                           note=f"ideal = {concurrency} ÷ {MEAN_S * 1000:.0f} ms = {ideal:.1f} msgs/s; steady state "
                                "(10%–90% of completions)"))
        out.append(summary(f"  same, end to end (start-up and drain included), concurrency {concurrency}",
                           end_to_end, ""))
        out.append(summary(f"  idem-etl ÷ naive loop (both steady state), concurrency {concurrency}", vs_naive, ""))
        out.append(summary(f"  idem-etl steady throughput, concurrency {concurrency}", rates, "", "msgs/s"))
    return out
