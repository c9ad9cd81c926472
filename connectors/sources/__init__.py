"""Sources: where messages come from, each with a stable position."""

from connectors.sources.base import Message, PartitionKey, PartitionLedger, Source
from connectors.sources.files import DirectorySource, FileSource, JsonlSource, ListSource, source_for_path

__all__ = [
    "DirectorySource",
    "FileSource",
    "JsonlSource",
    "ListSource",
    "Message",
    "PartitionKey",
    "PartitionLedger",
    "Source",
    "source_for_path",
]
