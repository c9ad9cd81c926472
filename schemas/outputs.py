"""Built-in output models for common stages."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Classification(BaseModel):
    """A label chosen from a fixed set; ``confidence`` is filled where the backend reports one."""

    label: str
    confidence: float | None = Field(default=None, ge=0.0, le=1.0)


class Receipt(BaseModel):
    """The four key fields of a retail receipt (as in the SROIE challenge)."""

    company: str = Field(max_length=80, description="the shop or company that issued the receipt")
    date: str = Field(max_length=24, description="the receipt date, as printed")
    address: str = Field(max_length=160, description="the shop address")
    total: float = Field(description="the total amount paid", ge=0)
