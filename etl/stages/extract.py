"""Extract: fill a pydantic model's fields from a document."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel

from connectors.store.tables import same_columns, typed_table_problem
from etl.errors import ConfigError
from etl.grounding import Grounder
from etl.stages.base import Predicate, Stage
from etl.stages.chunking import Chunking
from etl.stages.merge import Rule, rules_for
from etl.validators import Validator
from schemas import Document

Grounding = Literal["flag", "reask", "quarantine", "off"]


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class Extract(Stage):
    """Extracts ``schema``'s fields from each document it applies to.

    Results also land in a typed table (``table``, default: the schema's name in snake case) with one
    column per field, for analysts: ``SELECT total FROM receipt WHERE tenant = 'acme'``.

    Long documents: with ``chunking``, a document longer than a chunk is asked in chunks (see
    ``etl.stages.chunking``), each a cache entry of its own, and their answers are merged field by
    field (``merge``, see ``etl.stages.merge``) into the document's one result. ``grounding`` says
    what becomes of a value the document's text does not hold (``etl.grounding``): ``flag`` keeps
    it and marks its span ``none``, ``reask`` asks again (using a repair, ``repairs=`` of the run)
    naming the values not found and keeps and flags what is still not found (a re-asked answer that
    fails, invalid or refused or not delivered, leaves the first valid one; with ``repairs=0``
    nothing is re-asked and it acts as ``flag``), ``quarantine`` makes
    the document a dead letter (``ungrounded``), ``off`` looks for no span. Spans are stored in
    ``field_spans``. Only ``reask`` changes answers, so only it is in the fingerprint; a change
    between the others applies to documents answered after it.
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
        chunking: Chunking | None = None,
        merge: Mapping[str, str | Rule] | None = None,
        grounding: Grounding = "flag",
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
        if merge and chunking is None:
            raise ConfigError(f"stage {self.name!r}: merge rules apply to chunks; give chunking=Chunking() too")
        if grounding not in ("flag", "reask", "quarantine", "off"):
            raise ConfigError(f"stage {self.name!r}: grounding={grounding!r}; use 'flag', 'reask', 'quarantine' or 'off'")
        self.chunking = chunking
        self.merge = dict(merge or {})
        #: Every field's merge rule, checked against its type now rather than at the first long document.
        self.rules = rules_for(schema, self.merge, self.name) if chunking is not None else {}
        self.grounding = grounding

    def chunk_spec(self) -> dict[str, Any]:
        spec = super().chunk_spec()
        if self.grounding == "reask":  # it re-asks, so it decides answers
            spec["grounding"] = "reask"
        return spec

    def reask(self, output: BaseModel, document: Document) -> str | None:
        if self.grounding != "reask":
            return None
        lost = [span for span in Grounder(document.content).spans(output.model_dump(mode="json")) if not span.grounded]
        if not lost:
            return None
        named = ", ".join(f"{span.path}={span.value[:60]!r}" for span in lost[:5])
        return (f"{named} {'does' if len(lost) == 1 else 'do'} not appear in the text; copy every value as the "
                "text writes it, or use null where the text does not say")

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
