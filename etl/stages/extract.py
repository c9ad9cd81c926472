"""Extract: fill a pydantic model's fields from a document."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from connectors.store.tables import same_columns, typed_table_problem
from etl.errors import ConfigError
from etl.stages.base import Predicate, Stage
from etl.validators import Validator


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Extract(Stage):
    """Extracts ``schema``'s fields from each document it applies to.

    Results also land in a typed table (``table``, default: the schema's name in snake case) with one
    column per field, for analysts: ``SELECT total FROM receipt WHERE tenant = 'acme'``.
    """

    kind = "extract"

    def __init__(
        self,
        schema: type[BaseModel],
        instructions: str = "Extract the fields from the text.",
        *,
        name: str | None = None,
        when: Predicate | None = None,
        table: str | None = None,
        max_tokens: int = 256,
        validators: Sequence[Validator] = (),
    ) -> None:
        if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            raise ConfigError(f"Extract(schema=...) needs a pydantic model class, got {schema!r}")
        super().__init__(name or _snake(schema.__name__), instructions, when, max_tokens, validators)
        self.schema = schema
        self.table = table or _snake(schema.__name__)
        if not self.table.isidentifier():
            raise ConfigError(f"stage {self.name!r}: table {self.table!r} must be an identifier")
        problem = typed_table_problem(self.table, schema)
        if problem is not None:
            raise ConfigError(f"stage {self.name!r}: {problem}")

    def override(self, **changes: Any) -> Stage:
        """As :meth:`Stage.override`; another ``schema`` with other columns and no ``table`` gets its own
        default table (the new schema's name), not the one named after the schema it replaces."""
        if ("schema" in changes and "table" not in changes and self.table == _snake(self.schema.__name__)
                and not same_columns(self.schema, changes["schema"])):
            changes["table"] = None  # a schema with the same columns keeps writing where it did
        return super().override(**changes)

    @property
    def output_model(self) -> type[BaseModel]:
        return self.schema

    def llm_schema(self) -> dict[str, Any]:
        return self.schema.model_json_schema()

    def system_prompt(self) -> str:
        fields = "\n".join(
            f"- {name}: {info.description or name}" for name, info in self.schema.model_fields.items()
        )
        return f"{self.instructions}\nAnswer with one JSON object with these fields:\n{fields}"
