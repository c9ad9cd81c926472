"""Semantic validators: checks a schema cannot express, run on every output after pydantic.

A validator takes the validated output and returns an error message, or None when the output is
fine. The message is shown to the model in a repair re-ask, so say what is wrong and how to fix it.
Validators are part of the stage fingerprint (by name): tighten one and outputs are re-checked.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

from pydantic import BaseModel

#: Formats ``date_parses`` accepts, in the order tried (receipts print dates in many ways).
DATE_FORMATS = ("%Y-%m-%d", "%d/%m/%Y", "%d-%m-%Y", "%d.%m.%Y", "%m/%d/%Y", "%d/%m/%y", "%d-%m-%y",
                "%d %b %Y", "%d %B %Y", "%b %d, %Y", "%Y/%m/%d")


class Check:
    """A named validator. Plain callables work too; a Check keeps a readable, stable name."""

    def __init__(self, name: str, fn: Callable[[BaseModel], str | None]) -> None:
        self.name = name
        self.fn = fn

    def __call__(self, output: BaseModel) -> str | None:
        return self.fn(output)

    def __repr__(self) -> str:
        return self.name


Validator = Callable[[BaseModel], str | None]


def validator_name(validator: Validator) -> str:
    """What the fingerprint records for a validator."""
    if isinstance(validator, Check):
        return validator.name
    return f"{getattr(validator, '__module__', '')}.{getattr(validator, '__qualname__', repr(validator))}"


def _value(output: BaseModel, field: str) -> Any:
    return getattr(output, field, None)


def date_parses(field: str, formats: Collection[str] = DATE_FORMATS) -> Check:
    """The field is a date in one of ``formats`` (None passes: use the schema to require it)."""

    def check(output: BaseModel) -> str | None:
        value = _value(output, field)
        if value is None:
            return None
        for fmt in formats:
            try:
                datetime.strptime(str(value).strip(), fmt)
                return None
            except ValueError:
                continue
        return f"{field}={value!r} is not a date (expected e.g. 2024-03-18 or 18/03/2024)"

    return Check(f"date_parses({field})", check)


def non_negative(field: str) -> Check:
    """The field is a number >= 0."""

    def check(output: BaseModel) -> str | None:
        value = _value(output, field)
        if value is not None and value < 0:
            return f"{field}={value} must not be negative"
        return None

    return Check(f"non_negative({field})", check)


def not_empty(field: str) -> Check:
    """The field is present and not blank."""

    def check(output: BaseModel) -> str | None:
        value = _value(output, field)
        if value is None or (isinstance(value, str) and not value.strip()):
            return f"{field} must not be empty"
        return None

    return Check(f"not_empty({field})", check)
