"""Teacher-forced logprobs of given tokens on the embedded model (`POST /v1/score`, rollgym.scoring).

The context decodes the prompt as generation does (reusing the KV cache's common prefix), then the
completion tokens in batches that ask llama.cpp for the logits of every position (a generation asks
for the last one only), and reads log softmax(logits / T) at each next token. The cache then holds
these tokens, and llama-cpp-python's record of them (`input_ids`, `n_tokens`) says so, so the next
generation reuses what it shares with them. Runs on the generation thread only (GenerationQueue.run).
"""

from __future__ import annotations

from typing import Any, Sequence

import llama_cpp
import numpy as np

from .engine import ContextLengthError, LlamaEngine


def score_tokens(engine: LlamaEngine, prompt_ids: Sequence[int], completion_ids: Sequence[int],
                 temperature: float = 1.0, lora: Any = None) -> list[float]:
    """log p(completion_ids[j] | prompt_ids + completion_ids[:j]) for every j, under `lora` (None: base)."""
    tokens = [int(t) for t in (*prompt_ids, *completion_ids)]
    if len(tokens) > engine.n_ctx:
        raise ContextLengthError(len(tokens), engine.n_ctx)
    if not engine._busy.acquire(blocking=False):
        raise RuntimeError("LlamaEngine is not thread-safe; use GenerationQueue")
    try:
        engine.loras.activate(lora)
        llama = engine._llama
        head = len(prompt_ids) - 1  # the position whose logits predict the first completion token
        cached = llama.input_ids[: llama.n_tokens]
        common = 0
        limit = min(len(cached), head)
        if limit:
            differ = np.nonzero(cached[:limit] != np.asarray(tokens[:limit], dtype=cached.dtype))[0]
            common = int(differ[0]) if differ.size else limit
        llama.n_tokens = common
        if common < head:
            llama.eval(tokens[common:head])  # drops the cache past `common`; logits of the last position only
        scored = tokens[head:-1]  # positions head .. end-1 predict completion tokens 0 .. n-1
        llama._ctx.kv_cache_seq_rm(-1, llama.n_tokens, -1)
        rows: list[np.ndarray] = []
        for start in range(0, len(scored), llama.n_batch):
            batch = scored[start:start + llama.n_batch]
            n_past = llama.n_tokens
            llama._batch.set_batch(batch=batch, n_past=n_past, logits_all=True)
            llama._ctx.decode(llama._batch)
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(llama.ctx), shape=(len(batch), engine.n_vocab))
            rows.append(np.array(logits, dtype=np.float64))
            llama.input_ids[n_past:n_past + len(batch)] = batch
            llama.n_tokens += len(batch)
        llama._requires_eval = False
        logits = np.concatenate(rows) / temperature
        peak = logits.max(axis=1, keepdims=True)
        norm = peak[:, 0] + np.log(np.exp(logits - peak).sum(axis=1))
        chosen = logits[np.arange(len(completion_ids)), np.asarray(completion_ids)]
        return np.minimum(chosen - norm, 0.0).tolist()
    finally:
        engine._busy.release()


__all__ = ["score_tokens"]
