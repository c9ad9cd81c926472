"""LLM backends behind one async interface."""

from etl.llm.base import LLM, LLMRequest, LLMResponse
from etl.llm.local import LocalLLM
from etl.llm.openai_compat import OpenAICompatibleLLM

__all__ = ["LLM", "LLMRequest", "LLMResponse", "LocalLLM", "OpenAICompatibleLLM"]
