"""Benchmark: generation throughput and time to first token of the transformers model server's engine.

    .venv/bin/python scripts/bench_generate.py [--models tiny,smollm2] [--concurrency 1,16,64]
        [--engines continuous,waves,generate] [--device cpu] [--requests-per-client 2] [--waves-ref REV] [--distinct]
        [--deadline S]

Three engines get the same requests (chat prompts of mixed lengths, mixed output budgets, temperature 1):
- continuous: models/transformers/batching.py, the server's engine (a request joins the running batch);
- waves:      the engine the server had before it (static waves: rows leave a wave, none join), read from
              git at --waves-ref (default: the commit that replaced it) and driven the same way;
- generate:   Hugging Face `model.generate()` in static batches of C left-padded prompts, each batch run
              to its longest budget (only each request's own budget counts as output).
C clients each send their next request when the previous one is answered (closed loop), in-process (no
HTTP), until C x --requests-per-client are done. Each (model, engine, C) runs in a process of its own. Printed per model, engine and concurrency: output
tokens/s, time to first token (p50, p90) and latency p50, and a markdown table.

Models: `tiny` is a random-init Llama-shaped model (hidden 256, 4 layers, 8 heads, 2 KV heads) with
the bundled tokenizer; `smollm2` is the bundled SmolLM2-135M in Hugging Face form (its GGUF
dequantized once and cached, as the server and the trainer load it); `qwen-1.5b` a random-init model of
Qwen2.5-1.5B's shape (the GPU check's; bf16 on CUDA); `--hf PATH` adds any HF folder.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()  # --deadline counts from here, the imports below included
REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "services"), str(REPO)]

import torch  # noqa: E402

from models.transformers.batching import Scheduler  # noqa: E402
from models.transformers.engine import Engine, GenerationRequest  # noqa: E402

WAVES_REF = "588ec22"  # main before continuous batching
QUESTIONS = [
    "Say hi.",
    "Name three colours.",
    "What is 17 times 23? Answer with the number only.",
    "Write one short sentence about the sea and the sky at dawn, with a small boat on the horizon.",
    "List the planets of the solar system in order from the sun, then say which one is the largest and why "
    "astronomers call it a gas giant.",
    "A farmer has 17 sheep; all but 9 run away. How many are left? Think it through step by step, then give "
    "the answer on its own line, and explain the trick in the question in one more sentence. " * 2,
]
BUDGETS = [4, 8, 16, 16, 24, 32, 48, 64]


def tiny_llama(vocab: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    return LlamaForCausalLM(config).eval()


def qwen_1_5b(device: str) -> Any:
    """A random-init model of Qwen2.5-1.5B's shape (bf16, made on the device: seconds, not minutes)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, rope_theta=1e6)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if device.startswith("cuda")
                                                else torch.float32)


def load(name: str, device: str) -> tuple[Any, Any]:
    from rollgym.train.trainers.policy import load_base

    model, tokenizer = load_base("bundled" if name in ("smollm2", "tiny", "qwen-1.5b") else name)
    if name == "tiny":
        model = tiny_llama(len(tokenizer))
    elif name == "qwen-1.5b":  # the bundled tokenizer's ids all lie within its vocabulary
        model = qwen_1_5b(device)
    return model.to(device).eval(), tokenizer


def workload(engine: Engine, count: int, seed: int, distinct: bool = False) -> list[tuple[list[int], int]]:
    """(prompt ids, output budget) of `count` requests: mixed prompt lengths and budgets, the same for every engine.
    The questions repeat (as a GRPO group's prompt does); `distinct` numbers each one, so that no two are equal."""
    rng = random.Random(seed)
    return [(engine.render([{"role": "user", "content": (f"Request {i}. " if distinct else "") + rng.choice(QUESTIONS)}],
                           None), rng.choice(BUDGETS)) for i in range(count)]


def waves_module(ref: str) -> Any:
    """The previous engine module (BatchQueue, Engine), read from git at `ref` (or from the file `ref`, for a
    copy of the tree without git: scripts/gpu/wheels.sh writes one, and `waves_chat_format.py` beside it), with
    the chat_format module of its day (today's no longer has the names it imports), as a package of its own."""
    if Path(ref).is_file():
        engine = Path(ref).read_text()
        beside = Path(ref).with_name("waves_chat_format.py")
        chat_format = beside.read_text() if beside.is_file() else None
    else:
        def show(path: str) -> str:
            return subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:{path}"], check=True, capture_output=True,
                                  text=True).stdout

        engine, chat_format = show("models/transformers/engine.py"), show("models/transformers/chat_format.py")
    package = Path(tempfile.mkdtemp(prefix="waves-")) / "waves_baseline"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text(engine)
    if chat_format is not None:
        (package / "chat_format.py").write_text(chat_format)
    else:  # an older copy made by wheels.sh: today's module, which may lack what the baseline imports
        (package / "chat_format.py").write_text("from models.transformers.chat_format import *  # noqa: F403\n")
    sys.path.insert(0, str(package.parent))
    return importlib.import_module("waves_baseline.engine")


def timed_waves_engine(module: Any, model: Any, tokenizer: Any, n_ctx: int) -> Any:
    """The previous engine, noting when each wave picked its first tokens (every row of a wave gets its first
    token from the same step)."""

    class Timed(module.Engine):  # type: ignore[name-defined]
        def generate(self, requests: list[Any]) -> list[Any]:
            self._first = None
            results = super().generate(requests)
            for result in results:
                result.first_token_at = self._first
            return results

        def _pick(self, *args: Any, **kwargs: Any) -> Any:
            if self._first is None:
                self._first = time.perf_counter()
            return super()._pick(*args, **kwargs)

    return Timed(model, tokenizer, n_ctx=n_ctx)


async def closed_loop(submit: Any, make: Any, jobs: list[tuple[list[int], int]], concurrency: int) -> list[dict]:
    """`concurrency` clients, each sending its next job when the previous is answered."""
    queue = list(enumerate(jobs))
    stats: list[dict] = []

    async def client() -> None:
        while queue:
            index, (prompt, budget) = queue.pop(0)
            sent = time.perf_counter()
            result = await submit(make(prompt, budget, index))
            done = time.perf_counter()
            first = result.first_token_at or done
            stats.append({"tokens": len(result.token_ids), "ttft": first - sent, "latency": done - sent})

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return stats


def run_queue(queue: Any, request_class: Any, jobs: list[tuple[list[int], int]], concurrency: int) -> tuple[list, float]:
    def make(prompt: list[int], budget: int, index: int) -> Any:
        return request_class(prompt_ids=prompt, max_tokens=budget, temperature=1.0, seed=index)

    started = time.perf_counter()
    stats = asyncio.run(closed_loop(queue.submit, make, jobs, concurrency))
    return stats, time.perf_counter() - started


def run_generate(model: Any, tokenizer: Any, jobs: list[tuple[list[int], int]], concurrency: int,
                 eog: set[int]) -> tuple[list, float]:
    """HF generate() in static batches of `concurrency` left-padded prompts."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstStep(LogitsProcessor):
        at: float | None = None

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if self.at is None:
                self.at = time.perf_counter()
            return scores

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eog)
    device = next(model.parameters()).device
    stats: list[dict] = []
    started = time.perf_counter()
    for start in range(0, len(jobs), concurrency):
        batch = jobs[start:start + concurrency]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (prompt, _) in enumerate(batch):
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        first = FirstStep()
        sent = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                 temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max(b for _, b in batch),
                                 pad_token_id=pad, eos_token_id=sorted(eog), logits_processor=LogitsProcessorList([first]))
        done = time.perf_counter()
        for row, (_, budget) in enumerate(batch):
            tokens = out[row, width:width + budget].tolist()
            ended = next((i + 1 for i, t in enumerate(tokens) if t in eog), len(tokens))
            stats.append({"tokens": ended, "ttft": (first.at or done) - sent, "latency": done - sent})
    return stats, time.perf_counter() - started


def summary(stats: list[dict], wall: float) -> dict[str, float]:
    ttft = sorted(s["ttft"] for s in stats)
    return {"tok_s": sum(s["tokens"] for s in stats) / wall, "ttft_p50": statistics.median(ttft),
            "ttft_p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
            "latency_p50": statistics.median(s["latency"] for s in stats), "requests": len(stats),
            "tokens": sum(s["tokens"] for s in stats), "wall_s": wall}


def run_cell(name: str, kind: str, concurrency: int, args: argparse.Namespace) -> dict[str, Any]:
    """One model, engine and concurrency, from loading the model on."""
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(args.dtype) or (
        torch.bfloat16 if args.device.startswith("cuda") else torch.float32)
    model, tokenizer = load(name, args.device)
    model = model.to(dtype)
    engine = Engine(model, tokenizer, n_ctx=args.n_ctx)
    jobs = workload(engine, max(concurrency * args.requests_per_client, 4), seed=concurrency, distinct=args.distinct)
    slots = max(int(c) for c in args.concurrency.split(","))
    if kind == "continuous":
        queue = Scheduler(engine, lambda key: None, max_batch=slots, slot_tokens=args.n_ctx)
        run_queue(queue, GenerationRequest, jobs[:2], 2)  # warm-up
        stats, wall = run_queue(queue, GenerationRequest, jobs, concurrency)
        queue.close(5)
    elif kind == "waves":
        waves = waves_module(args.waves_ref)
        queue = waves.BatchQueue(timed_waves_engine(waves, model, tokenizer, args.n_ctx), lambda key: None,
                                 max_batch=slots)
        run_queue(queue, waves.GenerationRequest, jobs[:2], 2)
        stats, wall = run_queue(queue, waves.GenerationRequest, jobs, concurrency)
        queue.close(5)
    else:
        run_generate(model, tokenizer, jobs[:2], 2, set(engine.eog_ids))
        stats, wall = run_generate(model, tokenizer, jobs, concurrency, set(engine.eog_ids))
    return {**summary(stats, wall), "params_m": sum(p.numel() for p in model.parameters()) / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--hf", action="append", default=[], help="a Hugging Face model folder to add")
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--engines", default="continuous,waves,generate")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"])
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--waves-ref", default=WAVES_REF)
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default); on a shared "
                        "machine 1 spares every operation a wait for the other threads")
    parser.add_argument("--distinct", action="store_true", help="no two prompts equal (by default the 6 questions "
                        "repeat, and the continuous engine computes a prompt already in its batch once)")
    parser.add_argument("--deadline", type=float, default=0, help="seconds for the whole run (0: none): a cell "
                        "still running when they are spent is stopped, and the cells after it are not started; "
                        "each is listed with why")
    parser.add_argument("--cell", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    engines = args.engines.split(",")
    if not args.cell:
        print(f"machine: nproc={os.cpu_count()} loadavg={tuple(round(x, 2) for x in os.getloadavg())} "
              f"device={args.device} dtype={args.dtype} torch={torch.__version__} threads={torch.get_num_threads()} "
              f"prompts={'distinct' if args.distinct else 'repeating'}", flush=True)
    if args.cell:  # one cell, in a process of its own: no engine inherits another's threads or allocations
        name, kind, concurrency = args.cell.split(":")
        print("CELL " + json.dumps(run_cell(name, kind, int(concurrency), args)), flush=True)
        return
    rows = []
    ends = STARTED + args.deadline if args.deadline > 0 else None
    for name in args.models.split(",") + args.hf:
        for concurrency in levels:
            for kind in engines:
                left = None if ends is None else ends - time.perf_counter()
                if left is not None and left < 1:
                    print(f"{name} {kind} C={concurrency} not run: the --deadline's {args.deadline:.0f} s were "
                          "spent", flush=True)
                    continue
                command = [sys.executable, __file__, "--cell", f"{name}:{kind}:{concurrency}", *sys.argv[1:]]
                try:
                    done = subprocess.run(command, capture_output=True, text=True, timeout=left)
                except subprocess.TimeoutExpired:
                    print(f"{name} {kind} C={concurrency} stopped: still running when the --deadline's "
                          f"{args.deadline:.0f} s were spent", flush=True)
                    continue
                line = next((l for l in done.stdout.splitlines() if l.startswith("CELL ")), None)
                if line is None:
                    print(f"{name} {kind} C={concurrency} failed:\n{done.stderr[-2000:]}", flush=True)
                    continue
                result = json.loads(line[5:])
                params = result["params_m"]
                rows.append((name, params, kind, concurrency, result))
                print(f"{name} ({params:.0f}M) {kind:>10} C={concurrency:<3} {result['tok_s']:8.1f} tok/s  "
                      f"TTFT p50 {result['ttft_p50']:.3f} s p90 {result['ttft_p90']:.3f} s  latency p50 "
                      f"{result['latency_p50']:.3f} s  ({result['requests']} requests, {result['tokens']} tokens, "
                      f"{result['wall_s']:.1f} s)", flush=True)
    print("\n| model | engine | C | output tok/s | TTFT p50 (s) | TTFT p90 (s) | latency p50 (s) | × waves |")
    print("|---|---|---|---|---|---|---|---|")
    for name, params, kind, concurrency, result in rows:
        base = next((r for n, _, k, c, r in rows if n == name and k == "waves" and c == concurrency), None)
        ratio = f"{result['tok_s'] / base['tok_s']:.2f}" if base else "-"
        print(f"| {name} ({params:.0f}M) | {kind} | {concurrency} | {result['tok_s']:.1f} | {result['ttft_p50']:.3f} "
              f"| {result['ttft_p90']:.3f} | {result['latency_p50']:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
