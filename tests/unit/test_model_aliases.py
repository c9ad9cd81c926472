"""A model name that is an alias warns when the backend is built; pinned snapshots and self-hosted
names do not."""

from __future__ import annotations

import warnings

import pytest

from etl.llm.anthropic import AnthropicLLM
from etl.llm.base import ModelAliasWarning, alias_problem
from etl.llm.openai_compat import OpenAICompatibleLLM

OPENAI, ANTHROPIC, LOCAL = "https://api.openai.com/v1", "https://api.anthropic.com", "http://127.0.0.1:8000/v1"


@pytest.mark.parametrize(("model", "base_url"), [
    ("gpt-4o-mini", OPENAI), ("gpt-4.1", OPENAI), ("o3-mini", OPENAI), ("chatgpt-4o-latest", OPENAI),
    ("claude-sonnet-4-5", ANTHROPIC), ("claude-3-5-sonnet-latest", ANTHROPIC),
    ("llama3:latest", LOCAL), ("my-model-LATEST", LOCAL),
])
def test_aliases_are_named(model: str, base_url: str) -> None:
    problem = alias_problem(model, base_url)
    assert problem is not None and repr(model) in problem and "pin a dated snapshot" in problem


@pytest.mark.parametrize(("model", "base_url"), [
    ("gpt-4o-mini-2024-07-18", OPENAI), ("o3-mini-2025-01-31", OPENAI), ("claude-sonnet-4-5-20250929", ANTHROPIC),
    ("gpt-4-0613", OPENAI), ("gpt-3.5-turbo-0125", OPENAI), ("gpt-4-1106-preview", OPENAI),  # OpenAI's older snapshots
    ("gpt-4o-mini", LOCAL),  # a self-hosted server's names are its operator's
    ("smollm2-135m", LOCAL), ("text-embedding-3-small", OPENAI), ("latestness", LOCAL),
])
def test_pinned_and_self_hosted_names_are_not(model: str, base_url: str) -> None:
    assert alias_problem(model, base_url) is None


def test_the_backends_warn_when_built() -> None:
    with pytest.warns(ModelAliasWarning, match="gpt-4o-mini"):
        OpenAICompatibleLLM(OPENAI, "gpt-4o-mini", api_key="k")
    with pytest.warns(ModelAliasWarning, match="claude-sonnet-4-5"):
        AnthropicLLM("claude-sonnet-4-5", api_key="k")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OpenAICompatibleLLM(OPENAI, "gpt-4o-mini-2024-07-18", api_key="k")
        AnthropicLLM("claude-sonnet-4-5-20250929", api_key="k")
