"""What a run counts: for the progress bar, the metrics and the summary table."""

from __future__ import annotations

from dataclasses import dataclass

from etl.runtime.execute import Tally


@dataclass
class RunStats:
    """Counts for one run; what the progress bar, the metrics and the summary table show."""

    messages: int = 0
    stage_runs: int = 0
    stored_hits: int = 0
    cache_hits: int = 0
    llm_calls: int = 0
    #: Stage runs a router's student answered instead of the model.
    student_answers: int = 0
    results_written: int = 0
    dead_letters: int = 0
    #: Messages holding an older version of a document the store has a newer version of: no-ops.
    older_versions: int = 0
    saved_cost: float = 0.0
    in_flight: int = 0
    started: float = 0.0
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        """Share of stage runs served without a model call (stored results, cache, single-flight)."""
        return (self.stored_hits + self.cache_hits) / self.stage_runs if self.stage_runs else 0.0

    def add(self, tally: Tally) -> None:
        self.stage_runs += tally.stage_runs
        self.stored_hits += tally.stored_hits
        self.cache_hits += tally.cache_hits
        self.llm_calls += tally.llm_calls
        self.student_answers += tally.student_answers
        self.saved_cost += tally.saved_cost
