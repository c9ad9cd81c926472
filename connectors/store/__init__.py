"""The SQL store: tables, migrations, and one transaction per batch."""

from connectors.store.base import Batch, CacheEntry, DocRef, DocumentOutcome, Lookup, Store
from connectors.store.sql import SqlStore, make_engine, upgrade

__all__ = ["Batch", "CacheEntry", "DocRef", "DocumentOutcome", "Lookup", "SqlStore", "Store", "make_engine", "upgrade"]
