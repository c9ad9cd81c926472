"""Pydantic contracts shared by every package: the document envelope, provenance, output models."""

from schemas.document import Document, Position
from schemas.outputs import Classification, Receipt
from schemas.results import CallRecord, DeadLetter, Provenance, StageResult

__all__ = [
    "CallRecord",
    "Classification",
    "DeadLetter",
    "Document",
    "Position",
    "Provenance",
    "Receipt",
    "StageResult",
]
