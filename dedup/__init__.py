"""Hashing and idempotency: content hashes, stage fingerprints, cache keys, single-flight."""

from dedup.claims import Claims
from dedup.hashing import (
    cache_key,
    cache_keys,
    canonical_json,
    code_digest,
    content_hash,
    normalize_content,
    parsed_content_hash,
    sha256_hex,
    stage_fingerprint,
)
from dedup.singleflight import SingleFlight

__all__ = [
    "Claims",
    "SingleFlight",
    "cache_key",
    "cache_keys",
    "canonical_json",
    "code_digest",
    "content_hash",
    "normalize_content",
    "parsed_content_hash",
    "sha256_hex",
    "stage_fingerprint",
]
