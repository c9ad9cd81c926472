"""Every hash idem-etl takes: sha256 over canonical JSON or normalized text.

Never Python's ``hash()`` (salted per process), ``str(dict)`` (order- and repr-dependent) or
pickle (version-dependent): a key must be the same in every process, on every machine, forever.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import textwrap
import unicodedata
from collections.abc import Sequence
from typing import Any


#: A JSON string literal as ``json.dumps(..., ensure_ascii=False)`` writes it.
_string = json.encoder.encode_basestring


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
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text if text.isascii() else unicodedata.normalize("NFC", text)  # ASCII is NFC already


def content_hash(text: str) -> str:
    """sha256 of the normalized content."""
    return sha256_hex(normalize_content(text))


def parsed_content_hash(parser: str, text: str) -> str:
    """The content hash of a file's text: the normalized text *and* what read it (``"pypdf 7.1.1"``),
    so a parser upgrade is a new version of the document, never a silent change of its content."""
    return sha256_hex(canonical_json([parser, normalize_content(text)]))


def cache_key(tenant: str, fingerprint: str, content_digest: str) -> str:
    """The key of one LLM result: H(tenant, stage fingerprint, content hash).

    The tenant is part of the key, so one tenant can never be served another tenant's output.
    """
    return cache_keys(tenant, (fingerprint,), content_digest)[0]


def cache_keys(tenant: str, fingerprints: Sequence[str], content_digest: str) -> list[str]:
    """``cache_key`` for each fingerprint (every stage of a document at once)."""
    # Byte for byte canonical_json({"content": ..., "fingerprint": ..., "tenant": ...}), written out
    # because it runs for every stage of every message (a test holds the two forms equal).
    head = f'{{"content":{_string(content_digest)}'
    return [hashlib.sha256(f"{head}{_key_tail(fingerprint, tenant)}".encode()).hexdigest()
            for fingerprint in fingerprints]


@functools.lru_cache(maxsize=4096)
def _key_tail(fingerprint: str, tenant: str) -> str:
    return f',"fingerprint":{_string(fingerprint)},"tenant":{_string(tenant)}}}'



def stage_fingerprint(spec: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of everything that determines a stage's output.

    ``spec`` holds the stage kind and version, the rendered prompt template, the output JSON schema,
    the model id, the decoding parameters and any tenant overrides. Change any of them and the
    fingerprint changes; anything left out of ``spec`` cannot change it.
    """
    return sha256_hex(canonical_json(spec))


def code_digest(fn: Any) -> str:
    """sha256 of a function's source text (dedented), so editing its body changes every fingerprint
    it is part of; of its bytecode and constants when no source can be read (compiled, or typed at a
    prompt), which is stable within one Python version only."""
    fn = inspect.unwrap(getattr(fn, "__func__", fn))
    try:
        return sha256_hex(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        if code is None:
            return sha256_hex(f"{type(fn).__module__}.{type(fn).__qualname__}")
        return sha256_hex(code.co_code + repr(code.co_consts).encode())
