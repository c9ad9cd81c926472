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
    return merge_with_origins(outputs, rules)[0]


def merge_with_origins(outputs: Sequence[Mapping[str, Any]], rules: Mapping[str, Rule]
                       ) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`merge`, and where each field came from: per concat field the ``(chunk, item)`` of
    every merged item, per scalar field the chunk whose value it took (None for ``sum`` or no value)."""
    merged: dict[str, Any] = {}
    origins: dict[str, Any] = {}
    for name, rule in rules.items():
        values = [output.get(name) for output in outputs]
        present = [(number, value) for number, value in enumerate(values) if value is not None]
        if rule.how == "concat":
            items, seen, came = [], set(), []
            for number, value in present:
                for index, item in enumerate(value):
                    identity = canonical_json({k: item.get(k) for k in rule.key} if rule.key and isinstance(item, dict)
                                              else item)
                    if identity not in seen:
                        seen.add(identity)
                        items.append(item)
                        came.append((number, index))
            merged[name], origins[name] = items, came
        elif not present:
            merged[name], origins[name] = None, None
        elif rule.how == "first":
            origins[name], merged[name] = present[0]
        elif rule.how == "majority":
            counts = Counter(canonical_json(value) for _, value in present)
            best = max(counts.values())
            origins[name], merged[name] = next(pair for pair in present if counts[canonical_json(pair[1])] == best)
        elif rule.how in ("max", "min"):
            pick = max if rule.how == "max" else min
            origins[name], merged[name] = pick(present, key=lambda pair: pair[1])
        else:
            merged[name], origins[name] = sum(value for _, value in present), None
    return merged, origins


def merged_confidence(outputs: Sequence[Mapping[str, Any]], confidences: Sequence[Mapping[str, list[Any]] | None],
                      merged: Mapping[str, Any], origins: Mapping[str, Any],
                      rules: Mapping[str, Rule]) -> dict[str, list[Any]]:
    """Each merged value's confidence (``etl.confidence``): the log-probability its chunk gave it,
    where the chunk has one; else, for a scalar field two or more chunks answered, the share of
    those chunks that gave the merged value (``agreement``), which a ``majority`` field always
    gets (a vote is as sure as its margin). Nothing for a sum."""
    out: dict[str, list[Any]] = {}
    for name, origin in origins.items():
        if origin is None:
            continue
        if isinstance(origin, list):  # concat: item n of the merge is item k of chunk i
            for number, (chunk, index) in enumerate(origin):
                own = confidences[chunk] or {}
                prefix = f"{name}[{index}]"
                for path, value in own.items():
                    if path == prefix or path.startswith((prefix + ".", prefix + "[")):
                        out[f"{name}[{number}]{path[len(prefix):]}"] = value
            continue
        answered = [output.get(name) for output in outputs if output.get(name) is not None]
        voted = rules[name].how == "majority" and len(answered) >= 2  # a vote's sureness is its margin
        own = confidences[origin] or {}
        found = {path: value for path, value in own.items()
                 if path == name or path.startswith((name + ".", name + "["))}
        if found and not voted:
            out.update(found)
            continue
        if len(answered) >= 2 and not isinstance(merged[name], (dict, list)):
            agree = sum(canonical_json(value) == canonical_json(merged[name]) for value in answered)
            out[name] = [round(agree / len(answered), 6), "agreement"]
    return out
