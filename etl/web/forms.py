"""A correction form from a stage's output schema, and the answer it gives back.

Each top-level field becomes a typed input: an enum a choice, a number or integer a number field,
a boolean a choice of true/false, a string a text field; lists and nested objects are edited as
JSON. The answer is validated by the stage's own pydantic model, so a correction the pipeline could
not have produced is refused with the schema's own message beside its field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from etl.storable import value_problem

#: Output fields a reviewer does not correct (the model's own sureness).
NOT_CORRECTED = frozenset({"confidence"})


@dataclass(frozen=True)
class Field:
    name: str
    kind: str  # choice | integer | number | boolean | text | json
    required: bool
    nullable: bool
    choices: tuple[str, ...] = ()
    description: str = ""


def fields(model: type[BaseModel]) -> list[Field]:
    """The form's fields, in the schema's order."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    required = set(schema.get("required", []))
    out = []
    for name, prop in schema.get("properties", {}).items():
        if name in NOT_CORRECTED:
            continue
        options = [_resolve(o, defs) for o in prop.get("anyOf", [prop])]
        nullable = any(o.get("type") == "null" for o in options)
        main = next((o for o in options if o.get("type") != "null"), {})
        kind, choices = _kind(_resolve(main, defs))
        out.append(Field(name, kind, name in required, nullable, choices, str(prop.get("description", ""))))
    return out


def _resolve(prop: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = prop.get("$ref", "")
    return defs.get(ref.rsplit("/", 1)[-1], {}) if ref.startswith("#/$defs/") else prop


def _kind(prop: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    if "enum" in prop and all(isinstance(v, str) for v in prop["enum"]):
        return "choice", tuple(prop["enum"])
    if "const" in prop and isinstance(prop["const"], str):
        return "choice", (prop["const"],)
    kind = prop.get("type")
    return {"integer": ("integer", ()), "number": ("number", ()), "boolean": ("boolean", ()),
            "string": ("text", ())}.get(kind, ("json", ())) if isinstance(kind, str) else ("json", ())


def shown(field: Field, value: Any) -> str:
    """A value as its input shows it."""
    if value is None:
        return ""
    if field.kind == "json":
        return json.dumps(value, ensure_ascii=False, indent=1)
    if field.kind == "boolean":
        return "true" if value else "false"
    return str(value)


def read(model: type[BaseModel], form: dict[str, str]) -> tuple[dict[str, Any] | None, dict[str, str]]:
    """The corrected answer from the form (``f.<field>`` inputs) as the model validates it, or the
    problems by field name."""
    data: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for field in fields(model):
        raw = form.get(f"f.{field.name}", "")
        try:
            data[field.name] = _value(field, raw)
        except ValueError as exc:
            problems[field.name] = str(exc)
    if problems:
        return None, problems
    try:
        validated = model.model_validate(data)
    except ValidationError as exc:
        for error in exc.errors():
            where = str(error["loc"][0]) if error["loc"] else "answer"
            problems.setdefault(where, f"{'.'.join(map(str, error['loc'][1:])) + ': ' if len(error['loc']) > 1 else ''}"
                                       f"{error['msg']}")
        return None, problems
    try:
        answer = {k: v for k, v in validated.model_dump(mode="json").items() if k not in NOT_CORRECTED}
        problem = value_problem(answer, "corrected")
    except (ValueError, RecursionError):  # pydantic's serializer refuses nesting past its limit
        problem = "nested too deep to store"
    if problem is not None:  # as `etl review import` checks a file's
        return None, {"answer": problem}
    return answer, {}


def _value(field: Field, raw: str) -> Any:
    text = raw.strip() if field.kind != "text" else raw
    if not text.strip() and field.kind != "text":
        if field.nullable:
            return None
        raise ValueError("required")
    if field.kind == "text":
        return None if field.nullable and not raw.strip() else raw
    if field.kind == "integer":
        try:
            return int(text)
        except ValueError:
            raise ValueError("a whole number") from None
    if field.kind == "number":
        try:
            number = float(text)
        except ValueError:
            raise ValueError("a number") from None
        if not math.isfinite(number):
            raise ValueError("a finite number")
        return number
    if field.kind == "boolean":
        if text not in ("true", "false"):
            raise ValueError("true or false")
        return text == "true"
    if field.kind == "choice":
        if text not in field.choices:
            raise ValueError(f"one of {', '.join(field.choices)}")
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {getattr(exc, 'msg', exc)}") from None
    except RecursionError:
        raise ValueError("JSON nested too deep") from None
