"""Message → Document. Every way a message can be unusable ends here as a typed ``BadInput``."""

from __future__ import annotations

import functools
import json
from datetime import datetime, timezone
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from connectors.sources import Message
from dedup import normalize_content, parsed_content_hash, sha256_hex
from etl.errors import BadInput
from etl.formats import UnreadableFile, parse
from etl.storable import text_problem
from schemas import Document

#: Longest tenant and document key the store holds (``documents.tenant``, ``documents.doc_key``).
MAX_TENANT = 200
MAX_KEY = 500


def _checked(what: str, value: str, limit: int | None = None) -> str:
    """``value`` if the store can hold it as ``what``; raises BadInput otherwise."""
    if (problem := text_problem(value)) is not None:
        raise BadInput(f"{what} {problem}")
    if limit is not None and len(value) > limit:
        raise BadInput(f"{what} is {len(value)} characters, over the {limit}-character limit")
    return value


class Decoded(NamedTuple):
    """What the decoder read from a message, before the :class:`Document` envelope is built: enough
    to compute cache keys and find stored results, so a redelivery never pays for an envelope."""

    tenant: str
    key: str
    content: str
    content_hash: str
    fields: dict[str, Any]


class Decoder(BaseModel):
    """How a message's bytes become a Document.

    JSON messages: ``content_field`` holds the text, ``key_field`` the document key (falling back to
    the source's key, then to ``stream:partition:offset``), and the tenant comes from ``tenant_from``:
    ``"field:<name>"``, ``"header:<name>"`` or ``"key"``. Text messages (a directory of files) are the
    content themselves. Without a tenant the message goes to ``default_tenant``; set that to None to
    dead-letter such messages instead.

    File messages (``value_format="file"``: a PDF, an HTML page, text or Markdown, from
    ``FileSource`` or a Kafka message carrying the bytes) are parsed by ``etl.formats``: the content
    is the file's text, its hash covers the parser's name and version too, ``fields`` say the
    format, parser, page count and the bytes' sha256, and message headers (``tenant``) become fields.
    A file that cannot become text is a typed dead letter (``encrypted``, ``corrupt_file``,
    ``no_text``, ``too_large``), never a crash. ``max_file_bytes`` bounds them (``max_bytes`` the rest).

    Keys are typed so that two documents never share one by accident: with ``key_type="str"`` (the
    default) the key field must hold a string, with ``"int"`` an integer (stored as its decimal
    text); the other type is bad input, so ``1`` and ``"1"`` can never collapse into one document.
    A tenant field must hold a string. Tenants (up to 200 characters), keys (up to 500) and the
    content must be text the store can hold: no NUL, no lone surrogate.
    """

    model_config = ConfigDict(frozen=True)

    content_field: str = "text"
    key_field: str = "id"
    tenant_from: str = Field(default="field:tenant", pattern=r"^(field:.+|header:.+|key)$")
    default_tenant: str | None = "default"
    max_bytes: int = Field(default=1_000_000, gt=0)
    max_file_bytes: int = Field(default=50_000_000, gt=0)
    max_pages: int = Field(default=5000, gt=0)
    key_type: Literal["str", "int"] = "str"

    @field_validator("default_tenant")
    @classmethod
    def _a_name(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():  # '' is the store's mark of "no tenant"
            raise ValueError("default_tenant is blank: give a tenant's name, or None to dead-letter messages "
                             "that name none")
        return value

    def decode(self, message: Message, value_format: Literal["json", "text", "file"]) -> Document:
        """Raises BadInput with a one-line reason; the caller dead-letters the original bytes."""
        return self.document(self.read(message, value_format), message)

    def read(self, message: Message, value_format: Literal["json", "text", "file"]) -> Decoded:
        """``decode`` without the envelope (the hot path of every replay); raises BadInput."""
        value = message.value
        if value_format == "file":
            return self._file(message)
        if len(value) > self.max_bytes:
            raise BadInput(f"message is {len(value)} bytes, over the {self.max_bytes}-byte limit")
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadInput(f"not valid UTF-8 at byte {exc.start}") from exc
        fields: dict[str, Any] = {}
        if value_format == "json":
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as exc:
                raise BadInput(f"not valid JSON: {exc.msg} at column {exc.colno}") from exc
            except RecursionError:
                raise BadInput("JSON nested too deeply to decode") from None
            if not isinstance(fields, dict):
                raise BadInput(f"expected a JSON object, got {type(fields).__name__}")
            content = fields.get(self.content_field)
            if not isinstance(content, str) or not content or content.isspace():
                raise BadInput(f"field {self.content_field!r} is missing, empty or not a string")
        else:
            content = text
            if not content or content.isspace():
                raise BadInput("empty document")
        key = self._key(message, fields)
        tenant = self._tenant(message, fields)
        if tenant is None:
            raise BadInput(f"no tenant ({self.tenant_from}) and no default tenant is configured")
        fields.pop(self.content_field, None)  # the content travels on its own
        probe = tenant + key + content
        if "\x00" in probe or not probe.isascii() or len(tenant) > MAX_TENANT or len(key) > MAX_KEY:
            # Rare: say which of them the store could not hold (one look at all three first, since
            # this runs for every message of every replay).
            _checked("the content", content)
            _checked("the tenant", tenant, MAX_TENANT)
            _checked("the document key", key, MAX_KEY)
        content = normalize_content(content)
        return Decoded(tenant, key, content, sha256_hex(content), fields)  # content_hash, normalized once

    def _file(self, message: Message) -> Decoded:
        value = message.value
        unreadable = next((v for k, v in message.headers if k == "unreadable"), None)
        if unreadable is not None:  # a listed file the source could not read
            raise UnreadableFile(f"cannot read the listed file: {unreadable.decode('utf-8', 'replace')}", "missing_file")
        if len(value) > self.max_file_bytes:
            raise UnreadableFile(f"file is {len(value)} bytes, over the {self.max_file_bytes}-byte limit "
                                 "(Decoder(max_file_bytes=...))", "too_large")
        name = message.key.decode("utf-8", errors="replace") if message.key is not None else ""
        try:
            parsed = parse(value, name, max_pages=self.max_pages)
        except UnreadableFile as exc:  # the letter has no document key: its detail names the file
            raise UnreadableFile(f"{name}: {exc}" if name else str(exc), exc.reason) from exc
        fields: dict[str, Any] = {k: v.decode("utf-8", errors="replace") for k, v in message.headers}
        fields.update(format=parsed.format, parser=parsed.parser, pages=parsed.pages, bytes_sha256=sha256_hex(value))
        key, tenant = self._key(message, fields), self._tenant(message, fields)
        if tenant is None:
            raise BadInput(f"no tenant ({self.tenant_from}) and no default tenant is configured")
        # NUL and lone surrogates (a broken glyph) have no place in the store: replaced, not fatal
        text = parsed.text.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
        content = normalize_content(text)
        if not content.strip():
            raise UnreadableFile("the file has no text", "no_text")
        _checked("the content", content)
        _checked("the tenant", tenant, MAX_TENANT)
        _checked("the document key", key, MAX_KEY)
        return Decoded(tenant, key, content, parsed_content_hash(parsed.parser, content), fields)

    def _key(self, message: Message, fields: dict[str, Any]) -> str:
        key = fields.get(self.key_field)
        if key is None:
            if message.key is not None:
                return message.key.decode("utf-8", errors="replace")
            return f"{message.stream}:{message.partition}:{message.offset}"
        if self.key_type == "int":
            if type(key) is not int:
                raise BadInput(f"field {self.key_field!r} must be an integer (key_type='int'), "
                               f"got {type(key).__name__}")
            return str(key)
        if not isinstance(key, str):
            raise BadInput(f"field {self.key_field!r} must be a string, got {type(key).__name__} "
                           f"(it would collide with the string form; Decoder(key_type='int') takes integer ids)")
        if not key.strip():
            raise BadInput(f"field {self.key_field!r} is empty")
        return key

    @staticmethod
    def document(decoded: Decoded, message: Message) -> Document:
        # Every field was built and checked by ``read``: skip pydantic's validation.
        return Document.model_construct(
            tenant=decoded.tenant,
            key=decoded.key,
            content=decoded.content,
            content_hash=decoded.content_hash,
            position=message.position,
            fields=decoded.fields,
            received_at=datetime.now(timezone.utc),
        )

    @functools.cached_property
    def _tenant_source(self) -> tuple[str, str]:
        kind, _, name = self.tenant_from.partition(":")
        return kind, name

    def _tenant(self, message: Message, fields: dict[str, Any]) -> str | None:
        kind, name = self._tenant_source
        value: Any = None
        if kind == "field":
            value = fields.get(name)
        elif kind == "header":
            value = next((v.decode("utf-8", errors="replace") for k, v in message.headers if k == name), None)
        elif message.key is not None:
            value = message.key.decode("utf-8", errors="replace")
        if value is None or (isinstance(value, str) and not value.strip()):
            return self.default_tenant
        if not isinstance(value, str):
            raise BadInput(f"the tenant must be a string, got {type(value).__name__}")
        return value
