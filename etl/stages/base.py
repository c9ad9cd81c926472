"""What every stage is: a prompt, an output model, and the spec that fingerprints them."""

from __future__ import annotations

import inspect
import json
import re
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ValidationError

from dedup import sha256_hex
from etl.errors import ConfigError, Refusal, SchemaInvalid, SemanticInvalid, Truncated
from etl.llm.base import LLMRequest, LLMResponse, Message
from etl.stages.chunking import Chunk, Chunking
from etl.stages.merge import Rule
from etl.confidence import embedded_object
from etl.storable import value_problem
from dedup import code_digest
from etl.validators import Validator, validator_spec
from schemas import Document

#: Plain-text answers that decline rather than answer (for backends without a refusal field).
_REFUSAL = re.compile(r"^\s*(i'?m sorry|i am sorry|i can(?:no|')t|i cannot|i won'?t|as an ai)", re.IGNORECASE)

_CHECK_KINDS = ("validators", "field_validators", "root_validators", "model_validators", "field_serializers",
                "model_serializers")


def model_checks(model: type[BaseModel]) -> list[dict[str, Any]]:
    """The pydantic validators and serializers of ``model`` and of the models inside it, each by
    name, settings and the hash of its code: they decide which answers pass and what is stored, so
    they belong in the fingerprint as much as the JSON schema does."""
    found: list[dict[str, Any]] = []
    seen: set[type[BaseModel]] = set()

    def visit(annotation: Any) -> None:
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            if annotation in seen:
                return
            seen.add(annotation)
            decorators = annotation.__pydantic_decorators__
            for kind in _CHECK_KINDS:
                for name, decorator in sorted(getattr(decorators, kind).items()):
                    found.append({"model": annotation.__qualname__, "kind": kind, "name": name,
                                  "info": repr(decorator.info), "code": code_digest(decorator.func)})
            for info in annotation.model_fields.values():
                visit(info.annotation)
            return
        for arg in typing.get_args(annotation):
            visit(arg)

    visit(model)
    return found


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
    #: How a long document is cut (``etl.stages.chunking``); None: every document is read whole.
    chunking: Chunking | None = None
    #: Per output field, how the chunks' answers merge (``etl.stages.merge``).
    rules: Mapping[str, Rule] = {}

    def __init__(self, name: str, instructions: str, when: Predicate | None, max_tokens: int,
                 validators: Sequence[Validator] = ()) -> None:
        if not name.isidentifier():
            raise ConfigError(f"stage name {name!r} must be a Python identifier (letters, digits, _)")
        if not instructions.strip():
            raise ConfigError(f"stage {name!r} needs instructions: say what the model should do")
        self.name = name
        self.instructions = instructions.strip()
        self.when = when
        self.max_tokens = max_tokens
        self.validators = list(validators)

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
        """Everything of the stage's own that determines its output (the model is added by the
        runner): the chunk spec, and how chunks are cut and merged where the stage reads long
        documents in chunks."""
        spec = self.chunk_spec()
        if self.chunking is not None:
            spec["chunking"] = self.chunking.spec()
            spec["merge"] = {name: rule.spec() for name, rule in self.rules.items()}
        return spec

    def chunk_spec(self) -> dict[str, Any]:
        """What decides one answer: the prompt, schema and checks (for a chunk of a long document,
        not how the document was cut or merged, so a changed merge rule re-merges cached chunks
        without a call)."""
        return {
            "kind": self.kind,
            "version": self.version,
            "system": self.system_prompt(),
            "user": self.user_template(),
            "schema": self.llm_schema(),
            "output_schema": self.output_model.model_json_schema(),
            "max_tokens": self.max_tokens,
            "validators": [validator_spec(v) for v in self.validators],
            "model_checks": model_checks(self.output_model),
        }

    def reask(self, output: BaseModel, document: Document) -> str | None:
        """What is wrong with a valid answer that is worth asking again about (Extract's
        ``grounding="reask"``: values the text does not hold), or None."""
        return None

    def chunks_to_ask(self, parts: list[Chunk]) -> list[Chunk]:
        """Which chunks of a long document are asked (all of them, unless the stage says less)."""
        return parts

    def merged(self, output: dict[str, Any], confidence: Mapping[str, list[Any]]) -> dict[str, Any]:
        """The merged answer of a long document's chunks, as the stage completes it (Classify adds
        its confidence)."""
        return output

    def override(self, **changes: Any) -> Stage:
        """A copy with some constructor arguments replaced (per-tenant instructions, labels...).

        Raises:
            ConfigError: ``changes`` names something the stage's constructor does not take.
        """
        params = [p for p in inspect.signature(type(self).__init__).parameters if p != "self"]
        unknown = sorted(set(changes) - set(params))
        if unknown:
            raise ConfigError(f"stage {self.name!r}: cannot override {unknown}; it takes {params}")
        return type(self)(**{p: getattr(self, p) for p in params if hasattr(self, p)} | changes)

    def applies(self, outputs: Outputs) -> bool:
        return self.when is None or bool(self.when(outputs))

    def parse(self, response: LLMResponse) -> BaseModel:
        """Validates an answer in layers, whatever the backend promised (a constraint can fail
        silently): syntax → schema → semantic validators.

        Raises:
            Truncated: the answer stopped at the token limit (not a parse error).
            Refusal: the answer declines instead of answering.
            SchemaInvalid: no JSON object in the answer, it does not match ``output_model``, or it
                holds a value the store cannot (NaN, infinity, an integer beyond 64 bits, NUL).
            SemanticInvalid: it matches the schema but a validator rejects it.
        """
        text = response.text
        if response.finish_reason == "length":
            raise Truncated(f"answer hit max_tokens={self.max_tokens}", raw=text)
        if response.finish_reason == "refusal":
            raise Refusal(f"the model refused: {text[:200]}", raw=text)
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            found = embedded_object(text)
            if found is None:
                if _REFUSAL.match(text):
                    raise Refusal("the model declined to answer", raw=text) from None
                raise SchemaInvalid("the answer is not JSON", raw=text) from None
            data = found[0]
        except (ValueError, RecursionError) as exc:  # an integer of 5,000 digits, arrays 1,000 deep
            raise SchemaInvalid(f"the answer's JSON cannot be read: {str(exc)[:100]}", raw=text) from None
        try:
            output = self.output_model.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "answer"
            raise SchemaInvalid(f"{where}: {first['msg']}", raw=text) from exc
        try:
            problem = value_problem(output.model_dump())
            output.model_dump(mode="json")  # as the cache stores it
        except (ValueError, RecursionError):  # pydantic's serializer refuses nesting past its limit
            problem = "the answer nests too deep to store"
        if problem is not None:
            raise SchemaInvalid(problem, raw=text)  # valid for pydantic, but not storable
        for validator in self.validators:
            if (problem := validator(output)) is not None:
                raise SemanticInvalid(problem, raw=text)
        return output

    def repair(self, request: LLMRequest, answer: str, problem: str) -> LLMRequest:
        """The re-ask after an invalid answer: the conversation so far, and what was wrong."""
        messages = [*request.messages, {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"That answer is invalid: {problem}. "
                                                "Reply again with the corrected JSON object only."}]
        key = None if request.key is None else sha256_hex(f"{request.key}:repair:{len(messages)}")
        return LLMRequest(messages=messages, json_schema=request.json_schema, max_tokens=request.max_tokens, key=key)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
