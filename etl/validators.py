"""Semantic validators: checks a schema cannot express, run on every output after pydantic.

A validator takes the validated output and returns an error message, or None when the output is
fine. The message is shown to the model in a repair re-ask, so say what is wrong and how to fix it.

Validators are part of the stage fingerprint: tighten one and outputs are computed again. A
:class:`Check` is fingerprinted by its name and parameters (``date_parses("date", formats)``
records the formats); any other callable by the hash of its source code, with a warning, since a
change to what it reads from outside (a constant, a file) cannot be seen.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Collection
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from dedup import code_digest

#: Formats ``date_parses`` accepts, in the order tried (receipts print dates in many ways).
DATE_FORMATS = ("%Y-%m-%d", "%d/%m/%Y", "%d-%m-%Y", "%d.%m.%Y", "%m/%d/%Y", "%d/%m/%y", "%d-%m-%y",
                "%d %b %Y", "%d %B %Y", "%b %d, %Y", "%Y/%m/%d")


class Check:
    """A validator with a stable spec: its name and the parameters that decide what it accepts.

    Args:
        name: What it checks, e.g. ``"date_parses"``.
        fn: The check itself: output → error message or None.
        **params: Everything ``fn`` depends on besides the output (JSON values): they go into the
            stage fingerprint, so changing one re-runs the stage.
    """

    def __init__(self, name: str, fn: Callable[[BaseModel], str | None], **params: Any) -> None:
        self.name = name
        self.fn = fn
        self.params = params

    def __call__(self, output: BaseModel) -> str | None:
        return self.fn(output)

    def spec(self) -> dict[str, Any]:
        return {"check": self.name, "params": self.params}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args})"


Validator = Callable[[BaseModel], str | None]


def validator_spec(validator: Validator) -> dict[str, Any]:
    """What the fingerprint records for a validator: a Check's spec, else the callable's name and
    the hash of its code (warned about: use a Check for a spec that says what matters)."""
    if isinstance(validator, Check):
        return validator.spec()
    name = f"{getattr(validator, '__module__', '')}.{getattr(validator, '__qualname__', type(validator).__qualname__)}"
    warnings.warn(f"validator {name} is fingerprinted by its source code; wrap it in etl.Check(name, fn, **params) "
                  "so the stage fingerprint records what it depends on", stacklevel=3)
    return {"callable": name, "code": code_digest(validator)}


def _value(output: BaseModel, field: str) -> Any:
    return getattr(output, field, None)


def date_parses(field: str, formats: Collection[str] = DATE_FORMATS) -> Check:
    """The field is a date in one of ``formats`` (None passes: use the schema to require it)."""
    formats = list(formats)

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

    return Check("date_parses", check, field=field, formats=formats)


def non_negative(field: str) -> Check:
    """The field is a number >= 0."""

    def check(output: BaseModel) -> str | None:
        value = _value(output, field)
        if value is not None and value < 0:
            return f"{field}={value} must not be negative"
        return None

    return Check("non_negative", check, field=field)


def not_empty(field: str) -> Check:
    """The field is present and not blank."""

    def check(output: BaseModel) -> str | None:
        value = _value(output, field)
        if value is None or (isinstance(value, str) and not value.strip()):
            return f"{field} must not be empty"
        return None

    return Check("not_empty", check, field=field)
