"""Typed tables that follow their pydantic schema, as Alembic-managed schemas do.

Alembic's autogenerate compares each typed table with the table its schema makes today; what it
finds is one :class:`Change` per column:

- ``add``: a new field → a new nullable column (rows stored before have no value for it). Only the
  Extract stage re-runs, since its schema is part of its fingerprint.
- ``nullable``: a field made optional, or no longer a field at all → the column accepts NULL (a
  removed field's column and its values stay; drop it yourself if you mean to).
- ``type``: a field's type changed → the column's type changes, values cast in place.

A run makes the first two itself (they lose nothing); a type change it refuses with one line
that says what to run: ``etl db plan PIPELINE`` prints the statements, ``etl db upgrade PIPELINE``
runs them. Both run the same code, in one transaction: a plan is an upgrade rolled back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.operations import Operations
from pydantic import BaseModel, TypeAdapter, ValidationError
from sqlalchemy import Column, Connection, MetaData, Table, inspect, literal_column, select, text
from sqlalchemy.dialects.postgresql import JSONB

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
    _check: Any = None  # (connection) -> None; raises MigrationRefused

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
            change = _change(table, schema, op)
            if change is not None:
                found.append(change)
    return sorted(found, key=lambda c: (c.kind, c.column))


def _change(table: Table, schema: type[BaseModel], op: tuple[Any, ...]) -> Change | None:
    kind = op[0]
    if kind == "add_column":
        column: Column[Any] = op[3]
        new = Column(column.name, column.type, nullable=True)
        return Change(table.name, column.name, ADD, f"new column {column.type.compile()} NULL",
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
    if kind == "modify_type":
        name, old, new = op[3], op[5], op[6]
        nullable = op[4].get("existing_nullable", True)
        field = schema.model_fields[name]

        return Change(table.name, name, TYPE, f"type {old.compile()} → {new.compile()} (values cast in place)",
                      lambda batch: batch.alter_column(name, existing_type=old, type_=new, existing_nullable=nullable,
                                                       postgresql_using=_using(name, old, new)),
                      lambda conn: _check_values(conn, table.name, name, field.annotation, new))
    return None  # server defaults, indexes, comments: not the schema's business


def _check_values(conn: Connection, table: str, column: str, annotation: Any, new: Any) -> None:
    """Refuses a type change that a value stored in the column does not survive: the field's own
    type decides, as it does for new answers (a cast would turn 'n/a' into 0.0 on SQLite and 12.5
    into 13 on PostgreSQL, silently)."""
    adapter = TypeAdapter(annotation)
    bad = []
    for (value,) in conn.execute(select(literal_column(f'"{column}"')).select_from(text(f'"{table}"')).where(
            literal_column(f'"{column}"').is_not(None)).distinct()):
        try:
            adapter.validate_python(json.loads(value) if isinstance(new, JSONB) and isinstance(value, str) else value)
        except ValidationError:
            bad.append(value)
    if bad:
        raise MigrationRefused(
            f"{len(bad)} distinct value(s) of {table}.{column} are not a valid {new.compile()} for the field "
            f"(e.g. {bad[0]!r}): fix or delete those rows, or give the Extract stage a new table=")


def _using(column: str, old: Any, new: Any) -> str:
    """PostgreSQL's cast of a column's values to a new type: JSON scalars by their text."""
    quoted = f'"{column}"'
    if isinstance(new, JSONB):
        return f"to_jsonb({quoted})"
    value = f"({quoted} #>> '{{}}')" if isinstance(old, JSONB) else quoted
    return f"CAST({value} AS {new.compile(dialect=_pg())})"


def _pg() -> Any:
    from sqlalchemy.dialects import postgresql  # noqa: PLC0415

    return postgresql.dialect()


def apply(conn: Connection, name: str, found: list[Change]) -> None:
    """Makes ``found`` on table ``name`` inside the caller's transaction (SQLite: by copying the
    table where it cannot alter a column in place)."""
    if not found:
        return
    for change in found:
        if change._check is not None:  # noqa: SLF001
            change._check(conn)  # noqa: SLF001
    with Operations(MigrationContext.configure(conn)).batch_alter_table(name) as batch:
        for change in found:
            change._apply(batch)  # noqa: SLF001 - the change's own operation
