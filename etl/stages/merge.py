"""How the answers of a document's chunks become the document's one answer, field by field.

Declared on the ``Extract`` stage (``merge={"receipts": concat(key=("company", "date"))}``); a
field without a rule gets the default a user expects: list fields are concatenated in document
order without repeats, every other field takes the first chunk's non-null value. A rule that
cannot apply to its field (``sum`` of text, ``concat`` of a scalar, an unknown field) is an error
when the stage is built, not when the first long document arrives.
"""

from __future__ import annotations

import typing
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from dedup import canonical_json
from etl.errors import ConfigError

RULES = ("concat", "first", "majority", "max", "min", "sum")


@dataclass(frozen=True)
class Rule:
    """One field's merge: ``how`` is one of ``RULES``; ``key`` (concat only) names the item fields
    that make two list items the same item (default: the whole item)."""

    how: str
    key: tuple[str, ...] = ()

    def spec(self) -> dict[str, Any]:
        return {"how": self.how, "key": list(self.key)}


def concat(key: Sequence[str] = ()) -> Rule:
    """List items of every chunk in document order; an item equal (on ``key``) to an earlier one is dropped."""
    return Rule("concat", tuple(key))


def _is_list(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, frozenset, Sequence):
        return True
    return any(_is_list(arg) for arg in typing.get_args(annotation) if arg is not type(None))


def _is_number(annotation: Any) -> bool:
    if annotation in (int, float):
        return True
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    return bool(args) and all(_is_number(arg) for arg in args)


def rules_for(schema: type[BaseModel], declared: Mapping[str, str | Rule] | None, stage: str) -> dict[str, Rule]:
    """Every field's rule, checked against its type. Raises ConfigError for a rule that cannot apply."""
    declared = dict(declared or {})
    unknown = sorted(set(declared) - set(schema.model_fields))
    if unknown:
        raise ConfigError(f"stage {stage!r}: merge names {unknown}, which {schema.__name__} does not have")
    rules = {}
    for name, info in schema.model_fields.items():
        rule = declared.get(name) or ("concat" if _is_list(info.annotation) else "first")
        rule = rule if isinstance(rule, Rule) else Rule(rule)
        if rule.how not in RULES:
            raise ConfigError(f"stage {stage!r}: merge rule {rule.how!r} for {name!r}; use one of {list(RULES)}")
        if (rule.how == "concat") != _is_list(info.annotation):
            raise ConfigError(f"stage {stage!r}: field {name!r} is {'a list' if _is_list(info.annotation) else 'not a list'}: "
                              f"{'concat' if rule.how != 'concat' else 'first, majority'} fits it, not {rule.how!r}")
        if rule.how in ("max", "min", "sum") and not _is_number(info.annotation):
            raise ConfigError(f"stage {stage!r}: merge rule {rule.how!r} needs a number field, {name!r} is not one")
        rules[name] = rule
    return rules


def merge(outputs: Sequence[Mapping[str, Any]], rules: Mapping[str, Rule]) -> dict[str, Any]:
    """The document's answer from its chunks' validated answers (in document order)."""
    merged: dict[str, Any] = {}
    for name, rule in rules.items():
        values = [output.get(name) for output in outputs]
        present = [value for value in values if value is not None]
        if rule.how == "concat":
            items, seen = [], set()
            for value in present:
                for item in value:
                    identity = canonical_json({k: item.get(k) for k in rule.key} if rule.key and isinstance(item, dict)
                                              else item)
                    if identity not in seen:
                        seen.add(identity)
                        items.append(item)
            merged[name] = items
        elif not present:
            merged[name] = None
        elif rule.how == "first":
            merged[name] = present[0]
        elif rule.how == "majority":
            counts = Counter(canonical_json(value) for value in present)
            best = max(counts.values())
            merged[name] = next(value for value in present if counts[canonical_json(value)] == best)
        elif rule.how == "max":
            merged[name] = max(present)
        elif rule.how == "min":
            merged[name] = min(present)
        else:
            merged[name] = sum(present)
    return merged
