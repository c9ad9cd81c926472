"""Every hash idem-etl takes: sha256 over canonical JSON or normalized text.

Never Python's ``hash()`` (salted per process), ``str(dict)`` (order- and repr-dependent) or
pickle (version-dependent): a key must be the same in every process, on every machine, forever.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from typing import Any


def sha256_hex(data: str | bytes) -> str:
    """Hex sha256 of UTF-8 text or raw bytes."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> str:
    """JSON with sorted keys, no insignificant whitespace and no NaN, so equal values hash equal.

    Raises:
        TypeError: for values JSON cannot represent (sets, objects); convert them explicitly first.
        ValueError: for NaN or infinity, which have no canonical form.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def normalize_content(text: str) -> str:
    """The documented normalization applied before hashing content.

    Unicode NFC (so composed and decomposed accents are the same text) and line endings folded
    to ``\\n`` (so a Windows copy of a file is the same document). Nothing else: whitespace and
    case are content, a model may read them differently.
    """
    return unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n"))


def content_hash(text: str) -> str:
    """sha256 of the normalized content."""
    return sha256_hex(normalize_content(text))


def cache_key(tenant: str, fingerprint: str, content_digest: str) -> str:
    """The key of one LLM result: H(tenant, stage fingerprint, content hash).

    The tenant is part of the key, so one tenant can never be served another tenant's output.
    """
    return sha256_hex(canonical_json({"tenant": tenant, "fingerprint": fingerprint, "content": content_digest}))


def stage_fingerprint(spec: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of everything that determines a stage's output.

    ``spec`` holds the stage kind and version, the rendered prompt template, the output JSON schema,
    the model id, the decoding parameters and any tenant overrides. Change any of them and the
    fingerprint changes; anything left out of ``spec`` cannot change it.
    """
    return sha256_hex(canonical_json(spec))
