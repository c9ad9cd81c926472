"""What every stage is: a prompt, an output model, and the spec that fingerprints them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from etl.errors import ConfigError, SchemaInvalid, Truncated
from etl.llm.base import LLMResponse, Message
from schemas import Document

#: ``when=`` predicates see the validated outputs of the stages before them, by stage name.
Outputs = Mapping[str, BaseModel]
Predicate = Callable[[Outputs], bool]


class Stage(ABC):
    """One LLM step over a document.

    A stage is pure: it renders prompts and validates answers, and never does I/O. The runner owns
    caching, calls and writes, so every stage gets the same idempotency for free.
    """

    kind: ClassVar[str]
    #: Bump when a change to the class alters outputs for the same prompt and schema.
    version: ClassVar[int] = 1

    def __init__(self, name: str, instructions: str, when: Predicate | None, max_tokens: int) -> None:
        if not name.isidentifier():
            raise ConfigError(f"stage name {name!r} must be a Python identifier (letters, digits, _)")
        if not instructions.strip():
            raise ConfigError(f"stage {name!r} needs instructions: say what the model should do")
        self.name = name
        self.instructions = instructions.strip()
        self.when = when
        self.max_tokens = max_tokens

    @property
    @abstractmethod
    def output_model(self) -> type[BaseModel]:
        """The pydantic model every output is validated against before it is stored or cached."""

    @abstractmethod
    def llm_schema(self) -> dict[str, Any]:
        """The JSON schema the model is constrained to (may be narrower than ``output_model``)."""

    @abstractmethod
    def system_prompt(self) -> str:
        """The fixed part of the prompt. Documents go last so a backend can reuse the prefix."""

    def user_template(self) -> str:
        return "{content}"

    def render(self, document: Document) -> list[Message]:
        return [
            {"role": "system", "content": self.system_prompt()},
            {"role": "user", "content": self.user_template().format(content=document.content)},
        ]

    def spec(self) -> dict[str, Any]:
        """Everything of the stage's own that determines its output (the model is added by the runner)."""
        return {
            "kind": self.kind,
            "version": self.version,
            "system": self.system_prompt(),
            "user": self.user_template(),
            "schema": self.llm_schema(),
            "output_schema": self.output_model.model_json_schema(),
            "max_tokens": self.max_tokens,
        }

    def applies(self, outputs: Outputs) -> bool:
        return self.when is None or bool(self.when(outputs))

    def parse(self, response: LLMResponse) -> BaseModel:
        """Validates an answer, whatever the backend promised: a constraint can fail silently.

        Raises:
            Truncated: the answer stopped at the token limit.
            SchemaInvalid: the answer is not JSON or does not match ``output_model``.
        """
        if response.finish_reason == "length":
            raise Truncated(f"answer hit max_tokens={self.max_tokens}", raw=response.text)
        try:
            return self.output_model.model_validate_json(response.text)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "answer"
            raise SchemaInvalid(f"{where}: {first['msg']}", raw=response.text) from exc

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
