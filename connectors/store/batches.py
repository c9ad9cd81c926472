"""The ledger of provider batches: what was sent in which batch, written before the provider is asked.

A batch is recorded with its requests' ``custom_id``s *before* it is created at the provider, under
an id of ours that the provider keeps in the batch's metadata. Whatever a crash interrupts, a
restart reads the ledger: a ``custom_id`` in a live or finished batch is never sent again (its
answer is awaited, or read from the batch's output file); a batch recorded but not found at the
provider was never created, and is ``abandoned`` so its requests can go into a new one.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import Engine, func, insert, select, update

from connectors.store.tables import llm_batch_items, llm_batches
from connectors.store.write import members

LIVE = ("recorded", "submitted")
#: Finished batches whose output files still answer their requests.
ANSWERED = ("completed", "expired", "cancelled")


@dataclass(frozen=True)
class BatchRecord:
    id: str
    provider_id: str | None
    status: str
    lines: int
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: datetime | None = None  # when it was recorded (the store's clock)


class BatchLedger:
    def __init__(self, engine: Engine, pipeline: str, provider: str) -> None:
        self.engine = engine
        self.pipeline = pipeline
        self.provider = provider

    @staticmethod
    def new_id() -> str:
        """Ours, time-ordered (a later batch has a greater id), 32 characters."""
        return f"{time.time_ns():016x}{secrets.token_hex(8)}"

    def record(self, batch_id: str, custom_ids: Sequence[str]) -> None:
        with self.engine.begin() as conn:
            conn.execute(insert(llm_batches).values(id=batch_id, pipeline=self.pipeline, provider=self.provider,
                                                    lines=len(custom_ids)))
            conn.execute(insert(llm_batch_items), [{"batch_id": batch_id, "custom_id": c} for c in custom_ids])

    def submitted(self, batch_id: str, provider_id: str) -> None:
        self._set(batch_id, provider_id=provider_id, status="submitted")

    def closed(self, batch_id: str, status: str, output_file_id: str | None = None,
               error_file_id: str | None = None) -> None:
        self._set(batch_id, status=status, output_file_id=output_file_id, error_file_id=error_file_id,
                  closed_at=func.now())

    def _set(self, batch_id: str, **values: object) -> None:
        with self.engine.begin() as conn:
            conn.execute(update(llm_batches).where(llm_batches.c.id == batch_id).values(**values))

    def live(self) -> list[BatchRecord]:
        b = llm_batches.c
        with self.engine.connect() as conn:
            return [BatchRecord(r.id, r.provider_id, r.status, r.lines, r.output_file_id, r.error_file_id, r.created_at)
                    for r in conn.execute(select(llm_batches).where(
                        b.pipeline == self.pipeline, b.provider == self.provider, b.status.in_(LIVE))
                        .order_by(b.created_at))]

    def provider_ids(self) -> set[str]:
        """Every provider id in the ledger, of any pipeline (a batch to find again is none of these)."""
        with self.engine.connect() as conn:
            return set(conn.scalars(select(llm_batches.c.provider_id).where(llm_batches.c.provider_id.is_not(None))))

    def batches_of(self, custom_ids: Collection[str]) -> dict[str, BatchRecord]:
        """Each ``custom_id``'s latest batch that is live or answered it (failed and abandoned
        batches answered nothing: their requests are free to be sent again)."""
        b, i = llm_batches.c, llm_batch_items.c
        found: dict[str, BatchRecord] = {}
        with self.engine.connect() as conn:
            for (member,) in members(conn, sorted(custom_ids), i.custom_id):
                rows = conn.execute(select(i.custom_id, llm_batches).join(llm_batches, b.id == i.batch_id).where(
                    member, b.pipeline == self.pipeline, b.provider == self.provider,
                    b.status.in_((*LIVE, *ANSWERED))))
                for r in rows:  # ids are time-ordered: the greatest is the latest batch
                    if r.custom_id not in found or r.id > found[r.custom_id].id:
                        found[r.custom_id] = BatchRecord(r.id, r.provider_id, r.status, r.lines, r.output_file_id,
                                                         r.error_file_id)
        return found
