"""The SQL store: tables, migrations, and one transaction per batch."""

from connectors.store.base import (
    Batch,
    CacheEntry,
    DocRef,
    DocumentOutcome,
    Lookup,
    Store,
    TypedTable,
    Version,
)
from connectors.store.sql import SqlStore, behind, is_transient, make_engine, upgrade

__all__ = ["Batch", "CacheEntry", "DocRef", "DocumentOutcome", "Lookup", "SqlStore", "Store", "TypedTable", "Version",
           "behind", "is_transient", "make_engine", "upgrade"]
