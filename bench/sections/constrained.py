"""The local SmolLM2: outlines-constrained generation ÷ unconstrained llama.cpp."""

from __future__ import annotations

import json
import time

from etl.llm.base import LLMRequest

from bench.common import Figure, ROOT, RUNS, log, summary


def constrained_figures() -> list[Figure]:
    from etl import Extract, LocalLLM, Receipt  # noqa: PLC0415
    from schemas import Document, Position  # noqa: PLC0415

    llm = LocalLLM(n_ctx=2048)
    stage = Extract(Receipt, "Extract the receipt's key fields.")
    receipts = [json.loads(line) for line in (ROOT / "examples/data/receipts.jsonl").read_text().splitlines()[:5]]
    requests = [LLMRequest(stage.render(Document(tenant="t", key=r["id"], content=r["text"], content_hash="-",
                                                  position=Position(stream="s", offset=0))),
                           stage.llm_schema(), max_tokens=96) for r in receipts]
    import llama_cpp  # noqa: PLC0415

    llm.generate_sync(requests[0])  # load the model and build the constraint's index outside the timing
    context = llm._llama._ctx.ctx  # noqa: SLF001 - llama.cpp's own counters tell prompt time apart
    ratios, whole_ratios = [], []
    for r in range(RUNS):
        rates, whole = {}, {}
        for constrained in (True, False) if r % 2 == 0 else (False, True):
            tokens = seconds = prompt_s = 0.0
            for request in requests:
                llm._llama.reset()  # noqa: SLF001 - no prompt-cache advantage for either side
                llama_cpp.llama_perf_context_reset(context)
                started = time.perf_counter()
                response = llm.generate_sync(request, constrained=constrained)
                seconds += time.perf_counter() - started
                prompt_s += llama_cpp.llama_perf_context(context).t_p_eval_ms / 1000
                tokens += response.tokens_out
            # Generation speed: wall time minus the prompt's evaluation, which is the same work on
            # both sides (and would otherwise count against whichever side writes fewer tokens).
            rates[constrained] = tokens / (seconds - prompt_s)
            whole[constrained] = tokens / seconds
        ratios.append(rates[True] / rates[False])
        whole_ratios.append(whole[True] / whole[False])
        log(f"constrained run {r}: generation {rates[True]:.1f} vs {rates[False]:.1f} tokens/s; "
            f"with the prompt {whole[True]:.1f} vs {whole[False]:.1f}")
    return [
        summary("SmolLM2-135M generation tokens/s: outlines-constrained ÷ unconstrained llama.cpp", ratios, "≥ 0.8",
                met=lambda v: v >= 0.8,
                note="5 SROIE receipts, Receipt schema, max 96 tokens, greedy; wall time per generated token, "
                     "prompt evaluation (llama.cpp's own counter) excluded"),
        summary("  same, prompt evaluation included (constrained answers are shorter: ~64 vs 96 tokens)",
                whole_ratios, ""),
    ]
