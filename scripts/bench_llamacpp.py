"""Tokens/s of the embedded model server (`/v1/chat/completions`) against llama.cpp called directly.

Same model, prompts, seed, greedy decoding and token budget on both sides; the server is measured at
concurrency 1 and at concurrency 8 (requests queue FIFO on its one generation thread). Prints both
figures and the ratios (targets: >= 95% at concurrency 1, >= 90% at concurrency 8).

    .venv/bin/python scripts/bench_llamacpp.py [--tokens 64] [--prompts 8] [--threads N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a binary search does.",
    "List three uses of copper.",
    "Describe a sunrise in the mountains.",
    "What is the capital of Italy? Answer in a sentence and add a fact.",
    "Give two tips for learning a language.",
    "Summarise the water cycle.",
    "Why do cats purr?",
]


def direct(prompts: list[str], tokens: int, threads: int) -> tuple[int, float]:
    """Generated tokens and seconds for llama_cpp.Llama called in this process."""
    import llama_cpp

    from models.llamacpp.engine import bundled_model_path

    llm = llama_cpp.Llama(model_path=bundled_model_path(), n_ctx=2048, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)
    llm.create_chat_completion(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)
    total, started = 0, time.perf_counter()
    for prompt in prompts:
        out = llm.create_chat_completion(messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
                                         temperature=0.0, seed=0)
        total += out["usage"]["completion_tokens"]
    return total, time.perf_counter() - started


async def served(url: str, prompts: list[str], tokens: int, concurrency: int) -> tuple[int, float]:
    """Generated tokens and seconds through the server's /v1/chat/completions."""
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as http:

        async def one(prompt: str) -> int:
            async with semaphore:
                body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
                        "temperature": 0.0, "seed": 0}
                async with http.post(url + "/v1/chat/completions", json=body) as reply:
                    return (await reply.json())["usage"]["completion_tokens"]

        await one("hi")  # warm-up
        started = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
    return sum(counts), time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=max(1, min(4, (os.cpu_count() or 2) - 1)))
    args = parser.parse_args()
    prompts = (PROMPTS * (args.prompts // len(PROMPTS) + 1))[: args.prompts]

    from rollgym import Stack, load_stack

    config = load_stack([ROOT / "models/llamacpp/configs/llamacpp.yaml"],
                        [f"policy_model.n_threads={args.threads}", "policy_model.n_ctx=2048"])
    with Stack(config) as registry:
        url = registry["policy_model"].url
        rates = {}
        for concurrency in (1, 8):
            tokens, seconds = asyncio.run(served(url, prompts, args.tokens, concurrency))
            rates[concurrency] = tokens / seconds
    # Direct calls after the server: loading llama.cpp here first would start its OpenMP thread pool
    # in this process, which the forked server would then inherit broken (libgomp is not fork-safe).
    direct_tokens, direct_s = direct(prompts, args.tokens, args.threads)
    direct_rate = direct_tokens / direct_s
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}, llama.cpp threads {args.threads}")
    print(f"direct llama_cpp.Llama:             {direct_rate:7.1f} tokens/s ({direct_tokens} tokens)")
    for concurrency, rate in rates.items():
        print(f"server, concurrency {concurrency}:            {rate:7.1f} tokens/s  ratio {rate / direct_rate:.1%}")


if __name__ == "__main__":
    main()
