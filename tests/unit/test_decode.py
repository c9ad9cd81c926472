"""Every way a message can be unusable is a typed BadInput, never a crash."""

from __future__ import annotations

import json

import pytest

from connectors.sources import Message
from etl import BadInput, Decoder
from schemas import Position

POS = Position(stream="t", partition=2, offset=7)


def msg(value: bytes | dict, key: bytes | None = None, headers: tuple = ()) -> Message:
    raw = json.dumps(value).encode() if isinstance(value, dict) else value
    return Message(value=raw, stream=POS.stream, partition=POS.partition, offset=POS.offset, key=key, headers=headers)


def test_json_message_becomes_a_document() -> None:
    d = Decoder().decode(msg({"id": "a1", "tenant": "acme", "text": "hello\r\nworld", "lang": "en"}), "json")
    assert (d.tenant, d.key, d.content) == ("acme", "a1", "hello\nworld")
    assert d.fields == {"id": "a1", "tenant": "acme", "lang": "en"}
    assert d.position == POS


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"\xff\xfe not utf-8", "UTF-8"),
        (b"{not json", "JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"id": "x"}', "'text'"),
        (b'{"id": "x", "text": "   "}', "'text'"),
        (b'{"id": "x", "text": 5}', "'text'"),
    ],
)
def test_bad_messages_raise_bad_input(raw: bytes, fragment: str) -> None:
    with pytest.raises(BadInput, match=fragment) as info:
        Decoder().decode(msg(raw), "json")
    assert info.value.reason == "bad_input"


def test_size_limit() -> None:
    with pytest.raises(BadInput, match="over the 10-byte limit"):
        Decoder(max_bytes=10).decode(msg({"text": "a long enough text"}), "json")


def test_tenant_sources_and_default() -> None:
    body = {"text": "hi", "tenant": "from-field"}
    assert Decoder().decode(msg(body), "json").tenant == "from-field"
    assert Decoder(tenant_from="header:x-tenant").decode(msg(body, headers=(("x-tenant", b"h"),)), "json").tenant == "h"
    assert Decoder(tenant_from="key").decode(msg(body, key=b"k"), "json").tenant == "k"
    assert Decoder().decode(msg({"text": "hi"}), "json").tenant == "default"
    assert Decoder(default_tenant="other").decode(msg({"text": "hi"}), "json").tenant == "other"
    with pytest.raises(BadInput, match="no tenant"):
        Decoder(default_tenant=None).decode(msg({"text": "hi"}), "json")


def test_key_falls_back_to_source_key_then_position() -> None:
    assert Decoder().decode(msg({"text": "hi"}, key=b"kafka-key"), "json").key == "kafka-key"
    assert Decoder().decode(msg({"text": "hi"}), "json").key == "t:2:7"


def test_text_messages_are_their_own_content() -> None:
    d = Decoder().decode(msg(b"plain text file", key=b"dir/a.txt"), "text")
    assert (d.content, d.key, d.tenant) == ("plain text file", "dir/a.txt", "default")
    with pytest.raises(BadInput, match="empty"):
        Decoder().decode(msg(b" \n"), "text")
