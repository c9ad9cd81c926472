"""What the store can hold: checked at the boundary, so a value it would reject never reaches it.

PostgreSQL refuses NUL in text and JSON, UTF-8 cannot encode a lone surrogate (which a JSON
``\\ud800`` escape still produces), JSON has no NaN or infinity, and a typed table's integer column
is 64 bits. A message or a model answer holding any of these would make the whole batch's
transaction fail; found here, it is that one message's dead letter instead.
"""

from __future__ import annotations

import decimal
import math
from typing import Any

INT64 = (-(2**63), 2**63 - 1)


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text, or None."""
    if "\x00" in value:
        return "contains a NUL character"
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"contains a lone surrogate (\\u{ord(value[exc.start]):04x}) that is not valid Unicode"
    return None


def storable_text(value: str) -> str:
    """``value`` as the store can hold it, for text kept as evidence (a model's raw answer, an error
    detail): NUL becomes U+FFFD and a lone surrogate "?", so a bad answer keeps its own dead letter."""
    if text_problem(value) is None:
        return value
    return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def value_problem(value: Any, where: str = "answer") -> str | None:
    """Why ``value`` (a model output as Python data: dicts, lists, scalars) cannot be stored as JSON
    and in a typed column, naming where it sits (``amount``, ``items.2.price``), or None."""
    if isinstance(value, str):
        problem = text_problem(value)
        return None if problem is None else f"{where} {problem}"
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return None if INT64[0] <= value <= INT64[1] else f"{where}: {value} does not fit in 64 bits"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where}: {value} is not a finite number"
    if isinstance(value, decimal.Decimal):
        return None if value.is_finite() else f"{where}: {value} is not a finite number"
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{where}.{key}" if where != "answer" else str(key)
            if (problem := value_problem(str(key), inner) or value_problem(item, inner)) is not None:
                return problem
        return None
    if isinstance(value, (list, tuple, set, frozenset)):
        for index, item in enumerate(value):
            if (problem := value_problem(item, f"{where}.{index}")) is not None:
                return problem
    return None  # dates, times, UUIDs...: pydantic made them, the store takes them
