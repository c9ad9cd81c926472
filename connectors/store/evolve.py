"""Typed tables that follow their pydantic schema, as Alembic-managed schemas do.

Alembic's autogenerate compares each typed table with the table its schema makes today; what it
finds is one :class:`Change` per column:

- ``add``: a new field → a new nullable column (rows stored before have no value for it). Only the
  Extract stage re-runs, since its schema is part of its fingerprint.
- ``nullable``: a field made optional, or no longer a field at all → the column accepts NULL (a
  removed field's column and its values stay; drop it yourself if you mean to).
- ``type``: a field's type changed → the column is made anew with the new type, each stored value
  re-validated by pydantic as the field's new type and written back (a value that does not pass
  refuses the whole change).

A run makes the first two itself (they lose nothing); a type change it refuses with one line
that says what to run: ``etl db plan PIPELINE`` prints the statements, ``etl db upgrade PIPELINE``
runs them. Both run the same code, in one transaction: a plan is an upgrade rolled back.
"""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from pydantic import BaseModel, TypeAdapter, ValidationError
from sqlalchemy import JSON, Column, Connection, MetaData, Table, bindparam, inspect, select, update

from connectors.store.tables import TYPED_KEY_COLUMNS

ADD, NULLABLE, TYPE = "add", "nullable", "type"
#: Columns an idem-etl typed table has whatever its schema.
_OWN_COLUMNS = {*TYPED_KEY_COLUMNS, "cache_key"}


@dataclass(frozen=True)
class Change:
    """One column of a typed table that differs from what its schema makes today."""

    table: str
    column: str
    kind: str  # ADD | NULLABLE | TYPE
    detail: str
    _apply: Any  # (batch operations) -> None
    _before: Any = None  # (connection) -> None, before the alteration; raises MigrationRefused
    _after: Any = None  # (connection) -> None, after it

    @property
    def automatic(self) -> bool:
        """Whether a run makes it itself: it loses no value and breaks no reader."""
        return self.kind != TYPE

    def __str__(self) -> str:
        return f"{self.table}.{self.column}: {self.detail}"


class MigrationNeeded(ValueError):
    """Typed tables need changes a run does not make on its own (type changes)."""

    def __init__(self, needed: list[Change], target: str = "PIPELINE") -> None:
        self.needed = needed
        super().__init__(self.for_target(target))

    def for_target(self, target: str) -> str:
        """The one-line refusal, naming the pipeline as the user gave it."""
        return (f"typed table change(s) that a run does not make on its own: {'; '.join(map(str, self.needed))}; "
                f"see the statements with `etl db plan {target}`, run them with `etl db upgrade {target}`")


class MigrationRefused(ValueError):
    """A change would lose or alter stored values."""


class NotATypedTable(ValueError):
    """A table of that name exists but idem-etl did not make it."""


def changes(conn: Connection, table: Table, schema: type[BaseModel]) -> list[Change] | None:
    """What ``table`` (as its schema makes it) needs of the stored table; None if there is none.

    Raises:
        NotATypedTable: the stored table lacks the key columns every typed table has.
    """
    if not inspect(conn).has_table(table.name):
        return None
    stored = {c["name"] for c in inspect(conn).get_columns(table.name)}
    if not _OWN_COLUMNS <= stored:
        raise NotATypedTable(f"table {table.name!r} exists but is not an idem-etl typed table (it has no "
                             f"{sorted(_OWN_COLUMNS - stored)} column); pass Extract(table=...) another name")
    wanted = MetaData()
    table.to_metadata(wanted)
    context = MigrationContext.configure(conn, opts={
        "include_name": lambda name, kind, _parent: kind != "table" or name == table.name})
    found: list[Change] = []
    for diff in compare_metadata(context, wanted):
        for op in diff if isinstance(diff, list) else [diff]:
            change = _change(table, schema, op, conn.dialect)
            if change is not None:
                found.append(change)
    return sorted(found, key=lambda c: (c.kind, c.column))


def _change(table: Table, schema: type[BaseModel], op: tuple[Any, ...], dialect: Any) -> Change | None:
    kind = op[0]
    if kind == "add_column":
        column: Column[Any] = op[3]
        new = Column(column.name, column.type, nullable=True)
        return Change(table.name, column.name, ADD, f"new column {column.type.compile(dialect=dialect)} NULL",
                      lambda batch: batch.add_column(new))
    if kind == "modify_nullable" and op[6]:  # made nullable; a required field's NULL column stays
        name, existing = op[3], op[4]["existing_type"]
        return Change(table.name, name, NULLABLE, "accepts NULL (the field is optional now)",
                      lambda batch: batch.alter_column(name, existing_type=existing, nullable=True))
    if kind == "remove_column":
        column = op[3]
        if column.nullable:
            return None
        return Change(table.name, column.name, NULLABLE, "accepts NULL (no longer a field; its values stay)",
                      lambda batch: batch.alter_column(column.name, existing_type=column.type, nullable=True))
    if kind == "modify_type" and op[3] in schema.model_fields:  # not: a column idem-etl adds
        name, old, target = op[3], op[5], table.c[op[3]].type
        convert = _converter(schema.model_fields[name].annotation, isinstance(target, JSON))
        values: list[dict[str, Any]] = []
        return Change(
            table.name, name, TYPE, f"type {old.compile(dialect=dialect)} → {target.compile(dialect=dialect)} "
            "(each value re-validated as the field's new type and rewritten; the column accepts NULL)",
            lambda batch: (batch.drop_column(name), batch.add_column(Column(name, target, nullable=True))),
            lambda conn: values.extend(_converted(conn, table.name, name, convert)),
            lambda conn: _rewrite(conn, table, name, values))
    return None  # server defaults, indexes, comments: not the schema's business


def _converter(annotation: Any, to_json: bool) -> Any:
    """A stored value as the field's new type would hold it, by pydantic's rules (as new answers
    are checked), not SQL casts (SQLite's turn 'n/a' into 0.0 and '2024-01-05' into 2024). Scalars
    become text where the field is a string now."""
    adapter = TypeAdapter(annotation)

    def convert(value: Any) -> Any:
        try:
            valid = adapter.validate_python(value)
        except ValidationError:
            if annotation is not str or isinstance(value, (dict, list)):
                raise
            valid = value.isoformat() if isinstance(value, (dt.date, dt.datetime)) else json.dumps(value, default=str)
        return adapter.dump_python(valid, mode="json" if to_json else "python")

    return convert


def _converted(conn: Connection, table: str, column: str, convert: Any) -> list[dict[str, Any]]:
    """Every stored value of ``column`` converted, keyed by its row; refuses if any does not convert."""
    stored = Table(table, MetaData(), autoload_with=conn)
    rows, bad = [], []
    for p, t, k, value in conn.execute(select(stored.c.pipeline, stored.c.tenant, stored.c.doc_key, stored.c[column])):
        if value is None:
            continue
        try:
            rows.append({"_p": p, "_t": t, "_k": k, "_v": convert(value)})
        except (ValidationError, ValueError, TypeError):
            bad.append(value)
    if bad:
        example = repr(bad[0])
        raise MigrationRefused(
            f"{len(bad)} value(s) of {table}.{column} are not valid for the field's new type (e.g. "
            f"{example[:60] + '…' if len(example) > 60 else example}): fix or delete those rows, or give the "
            "Extract stage a new table=")
    return rows


def _rewrite(conn: Connection, table: Table, column: str, values: list[dict[str, Any]]) -> None:
    if values:
        c = table.c
        conn.execute(update(table).where(c.pipeline == bindparam("_p"), c.tenant == bindparam("_t"),
                                         c.doc_key == bindparam("_k")).values({column: bindparam("_v")}), values)


def apply(conn: Connection, name: str, found: list[Change]) -> None:
    """Makes ``found`` on table ``name`` inside the caller's transaction (SQLite: by copying the
    table where it cannot alter a column in place)."""
    if not found:
        return
    for change in found:
        if change._before is not None:  # noqa: SLF001 - reads (and checks) values first
            change._before(conn)  # noqa: SLF001
    sqlite = conn.dialect.name == "sqlite"
    if sqlite:  # the copy's rename must not rewrite (and fail on) views that name the table
        conn.exec_driver_sql("PRAGMA legacy_alter_table=ON")
    try:
        with Operations(MigrationContext.configure(conn)).batch_alter_table(name) as batch:
            for change in found:
                change._apply(batch)  # noqa: SLF001 - the change's own operation
    finally:
        if sqlite:
            conn.exec_driver_sql("PRAGMA legacy_alter_table=OFF")
    for change in found:
        if change._after is not None:  # noqa: SLF001
            change._after(conn)  # noqa: SLF001
