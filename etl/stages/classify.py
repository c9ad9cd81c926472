"""Classify: pick one label from a fixed set."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from etl.confidence import from_logprobs
from etl.errors import ConfigError
from etl.llm.base import LLMResponse
from etl.stages.base import Outputs, Predicate, Stage
from etl.stages.chunking import Chunk, Chunking
from etl.stages.merge import Rule
from etl.stages.routing import Router
from etl.validators import Validator
from schemas import Classification



class Classify(Stage):
    """Chooses one of ``labels`` for each document.

    The model is constrained to the label set and asked for ``{"label": ...}`` only; a confidence is
    added when the backend reports one, or the label tokens' log-probability where it reports those
    (it is never asked of the model, which would make it up).

    Long documents: with ``chunking``, a document longer than a chunk is classified by its chunks'
    ``vote``: ``majority`` asks every chunk (each a cache entry) and takes the most common label,
    its confidence the share of chunks that chose it; ``head`` asks the first chunk only.
    """

    kind = "classify"

    def __init__(
        self,
        labels: Sequence[str],
        instructions: str = "Classify the text.",
        *,
        name: str = "classify",
        when: Predicate | None = None,
        max_tokens: int = 48,
        validators: Sequence[Validator] = (),
        router: Router | None = None,
        chunking: Chunking | None = None,
        vote: Literal["majority", "head"] = "majority",
    ) -> None:
        labels = list(labels)
        if not labels:
            raise ConfigError(f"stage {name!r}: labels is empty; give at least two labels")
        if len(set(labels)) != len(labels):
            dupes = sorted({label for label in labels if labels.count(label) > 1})
            raise ConfigError(f"stage {name!r}: duplicate labels {dupes}; each label must appear once")
        if any(not isinstance(label, str) or not label.strip() for label in labels):
            raise ConfigError(f"stage {name!r}: every label must be a non-empty string")
        if vote not in ("majority", "head"):
            raise ConfigError(f"stage {name!r}: vote={vote!r}; use 'majority' (every chunk votes) or 'head' (the first chunk)")
        super().__init__(name, instructions, when, max_tokens, validators)
        self.labels = labels
        self.chunking = chunking
        self.vote = vote
        self.rules = {"label": Rule("majority" if vote == "majority" else "first")} if chunking is not None else {}
        #: A distilled student answers what it is sure about (``etl distill``); not in the
        #: fingerprint: it decides who answers, never what the model is asked.
        self.router = router
        self._model: type[BaseModel] = create_model(
            f"{name}_classification",
            __base__=Classification,
            label=(Literal[tuple(labels)], Field(description="one of the labels")),  # type: ignore[valid-type]
        )

    @property
    def output_model(self) -> type[BaseModel]:
        return self._model

    def llm_schema(self) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"label": {"type": "string", "enum": self.labels}},
            "required": ["label"],
            "additionalProperties": False,
        }

    def system_prompt(self) -> str:
        return (
            f"{self.instructions}\n"
            f"Labels: {', '.join(self.labels)}\n"
            'Answer with JSON only: {"label": "<one of the labels>"}'
        )

    def parse(self, response: LLMResponse) -> BaseModel:
        output = super().parse(response)
        confidence = response.confidence
        if confidence is None and response.token_logprobs:  # the label's tokens' probability
            confidence = from_logprobs(response.text, response.token_logprobs).get("label", [None])[0]
        if confidence is not None and 0.0 <= confidence <= 1.0:  # NaN compares False
            output = output.model_copy(update={"confidence": confidence})
        return output

    def chunks_to_ask(self, parts: list[Chunk]) -> list[Chunk]:
        return parts[:1] if self.vote == "head" else parts

    def merged(self, output: dict[str, Any], confidence: Mapping[str, list[Any]]) -> dict[str, Any]:
        sure = confidence.get("label", [None])[0]
        return {**output, "confidence": sure} if sure is not None else output

    def check_labels(self, labels: Collection[str], where: str) -> None:
        """Raises ConfigError when ``labels`` names a label this stage can never produce."""
        unknown = sorted(set(labels) - set(self.labels))
        if unknown:
            raise ConfigError(
                f"{where}: unknown label(s) {unknown} for stage {self.name!r}; "
                f"check the spelling against its {len(self.labels)} labels"
            )


class LabelIn:
    """A ``when=`` predicate: the named classify stage chose one of ``labels``.

    Unlike a lambda it can be checked when the pipeline is built, so a misspelt label is a clear
    error at start-up rather than a stage that silently never runs.
    """

    def __init__(self, stage: str, labels: Collection[str]) -> None:
        self.stage = stage
        self.labels = frozenset(labels)

    def __call__(self, outputs: Outputs) -> bool:
        output = outputs.get(self.stage)
        return output is not None and getattr(output, "label", None) in self.labels

    def __repr__(self) -> str:
        return f"label_in({self.stage!r}, {sorted(self.labels)!r})"


def label_in(stage: str, *labels: str) -> LabelIn:
    """``Extract(..., when=label_in("intent", "card_arrival", "card_linking"))``."""
    return LabelIn(stage, labels)
