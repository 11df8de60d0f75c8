"""The phase breakdown of `rollgym train` epochs, and the throughput of the `grpo` trainer's step.

    python scripts/bench_train.py                 # run one epoch of the demo plan (rs-sft) and report it
    python scripts/bench_train.py runs/demo-s0    # report every epoch of a finished or running run
    python scripts/bench_train.py --device cuda   # the trainer's step: tokens/s, MFU, peak memory
    python scripts/bench_train.py --device cpu    # the same on the CPU (a tiny random model beside the bundled one)

Overhead = everything but generation (collect, validate) and the trainer's train() call: curation,
the trainer process's start and model load, the merged GGUF export, apply, bookkeeping.

The step benchmark (`--device`) times `PolicyTrainer.train_batch` (forward, loss, backward, AdamW) on
synthetic rollouts, for LoRA and full weights, on the bundled SmolLM2-135M and on a randomly
initialised Qwen2-shaped model (1.5B on a GPU: hidden 1536, 28 layers, vocabulary 151936; a tiny
one on the CPU), with no download. It prints per configuration: the step's seconds, tokens/s (all
tokens of the batch, prompt included), MFU (model FLOPs per second over the card's peak dense bf16
FLOP/s; n/a on the CPU or an unknown card), peak memory (CUDA: allocated; CPU: the process's peak
RSS so far), the estimate of weights + gradients + AdamW state, that plus one micro-batch's
activations (`activation_estimate`; the goal: peak within 1.2× of it), and once per model the mean |Δ|
between the trainer's bf16-autocast and fp32 logprobs on the same tokens.

Model FLOPs per token, full weights: 6·N (N: the decoder's matrix weights) + 6·L·d·T (causal
attention over a rollout of T tokens) and 6·V·d per loss token (the output layer sees only those);
with a LoRA the frozen weights get no weight gradient, so 4·N and 4·V·d (attention has no weights:
still 6·L·d·T). Two more MFU columns count the same step otherwise: `-attn` leaves attention's FLOPs out
(the matrix weights only), and `tt` counts them as torchtitan's and prime-rl's perf.py do, 6·N' + 12·L·d·S
per token (N': every parameter but the input embedding, the output layer on every token; S: the row's
length, packed rows counted whole; no causal halving).
"""

from __future__ import annotations

import argparse
import gc
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import orjson

REPO = Path(__file__).resolve().parents[1]
PLAN = REPO / "scripts/train/weather.yaml"

# Peak dense bf16 tensor FLOP/s, by a part of the name torch reports (first match wins).
PEAK_BF16 = [("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("GH200", 989.4e12), ("B200", 2250e12),
             ("A100", 312e12), ("L40S", 362e12), ("A10G", 70e12), ("L4", 121e12), ("RTX 4090", 165e12)]


def report(run: Path) -> None:
    lines = [orjson.loads(x) for x in (run / "history.jsonl").read_bytes().splitlines() if x.strip()]
    print(f"{'epoch':>5} {'stage':<8} {'collect':>8} {'curate':>7} {'load':>6} {'train':>7} {'export':>7} "
          f"{'optimize':>8} {'apply':>6} {'validate':>8} {'total':>7} {'overhead':>9}")
    for line in lines:
        phases = line.get("phases_s", {})
        metrics = line.get("train") or {}
        total = sum(phases.values())
        overhead = line.get("overhead_s")
        share = f"{overhead:.1f} ({overhead / total:.1%})" if overhead is not None and total else "-"
        print(f"{line['epoch']:>5} {(line.get('stage') or 'base'):<8} {phases.get('collect', 0):>8.1f} "
              f"{phases.get('curate', 0):>7.2f} {metrics.get('load_s', 0):>6.1f} {metrics.get('train_s', 0):>7.1f} "
              f"{metrics.get('export_s', 0):>7.1f} {phases.get('optimize', 0):>8.1f} {phases.get('apply', 0):>6.2f} "
              f"{phases.get('validate', 0):>8.1f} {total:>7.1f} {share:>9}")


def phase_breakdown() -> None:
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        import yaml

        plan = yaml.safe_load(PLAN.read_text())
        plan["stages"] = plan["stages"][:1]
        plan["output"] = str(Path(tmp) / "run")
        path = Path(tmp) / "plan.yaml"
        path.write_text(yaml.safe_dump(plan))
        subprocess.run([sys.executable, "-m", "rollgym.cli", "train", str(path), "--no-progress"], cwd=REPO,
                       check=True)
        report(Path(tmp) / "run")


# ---------------------------------------------------------------------------- the trainer's step


def qwen_config(device: str) -> Any:
    from transformers import Qwen2Config

    if device == "cuda":  # Qwen2.5-1.5B's shape
        return Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                           num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                           tie_word_embeddings=True, rope_theta=1e6)
    return Qwen2Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                       tie_word_embeddings=True)


def random_model(device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: seconds on a GPU, not minutes on the host
        return AutoModelForCausalLM.from_config(qwen_config(device), dtype=torch.float32)


def bundled_model(_device: str) -> Any:
    from rollgym.train.trainers.policy import load_base

    return load_base("bundled")[0]


def with_lora(model: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    from rollgym.train.trainers.policy import LORA_TARGETS

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"))


def synthetic_batch(vocab: int, rollouts: int, prompt: int, completion: int) -> list[Any]:
    """Rollouts of random tokens whose sampling logprobs are a uniform model's (ρ near 1 at random init)."""
    import torch

    from rollgym.train.trainers.grpo_trainer import TrainSequence

    generator = torch.Generator().manual_seed(1)
    out = []
    for i in range(rollouts):
        ids = torch.randint(0, vocab, (prompt + completion,), generator=generator).tolist()
        out.append(TrainSequence(ids[:prompt], ids[prompt:], [1] * completion, [-math.log(vocab)] * completion,
                                 advantage=1.0 if i % 2 else -1.0, temperature=1.0))
    return out


def model_flops(model: Any, batch: list[Any], full: bool, attention: bool = True) -> float:
    """Model FLOPs of one training step on `batch` (see the module's docstring); `attention` False: the
    matrix weights' FLOPs only."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = causal.config
    head = causal.get_output_embeddings().weight
    body = sum(p.numel() for name, p in causal.named_parameters()
               if p.dim() == 2 and "lora_" not in name and p is not head and "embed" not in name and "wte" not in name)
    factor = 6 if full else 4
    flops = 0.0
    for seq in batch:
        length = seq.length
        flops += factor * body * length
        if attention:
            flops += 6 * config.num_hidden_layers * config.hidden_size * length * length  # causal: half of 12·L·d·T²
        flops += factor * head.numel() * seq.loss_tokens
    return flops


def torchtitan_flops(model: Any, batch: list[Any], seq_len: int | None) -> float:
    """FLOPs of the step as torchtitan's and prime-rl's perf.py count them: (6·N' + 12·L·d·S) per token,
    N' every parameter but the input embedding, S the row's length (a packed row counted whole)."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = causal.config
    embedding = causal.get_input_embeddings().weight
    params = sum(p.numel() for p in {id(p): p for p in causal.parameters()}.values()
                 if p is not embedding and p.dim() > 0)
    if causal.get_output_embeddings().weight is embedding:  # tied: the output layer still does its matmul
        params += embedding.numel()
    tokens = sum(seq.length for seq in batch)
    rows = [seq_len] * math.ceil(tokens / seq_len) if seq_len else [seq.length for seq in batch]
    attention = sum(12 * config.num_hidden_layers * config.hidden_size * row * row for row in rows)
    return 6 * params * tokens + attention * tokens / sum(rows)


def state_estimate(model: Any) -> float:
    """Bytes of fp32 weights, their gradients and AdamW's two moments (activations excluded)."""
    params = list({id(p): p for p in model.parameters()}.values())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return 4.0 * sum(p.numel() for p in params) + 12.0 * trainable


def activation_estimate(model: Any, tokens: int, loss_fraction: float) -> float:
    """Bytes of what one micro-batch keeps for its backward pass, for a Llama/Qwen-shaped decoder under bf16
    autocast over fp32 weights (fp32 residual stream and norms, bf16 matrix products, flash attention:
    no length² term), full weights and no gradient checkpointing: per layer and token about 34·d bytes
    around the attention and 8·I in the SwiGLU MLP (d: hidden, I: intermediate size), and the loss
    tokens' logits (2·V bytes each in bf16, plus one fp32 chunk of the softmax at a time)."""
    causal = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = causal.config
    per_layer = tokens * (34 * config.hidden_size + 8 * config.intermediate_size)
    logits = tokens * loss_fraction * config.vocab_size * 2 + 2048 * config.vocab_size * 4 * 2
    return config.num_hidden_layers * per_layer + logits


def peak_flops(device: str) -> float | None:
    import torch

    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((peak for part, peak in PEAK_BF16 if part in name), None)


def peak_memory(device: str) -> float:
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def bf16_gap(trainer: Any, batch: list[Any]) -> float:
    """Mean |log π_bf16 − log π_fp32| per token: the trainer's logprobs under autocast and without, same weights."""
    import torch

    module = trainer.module
    values = {}
    for precision in ("fp32", "bf16"):
        module.precision = precision
        values[precision] = torch.cat(trainer._logprobs_no_grad(batch))
    module.precision = trainer.precision
    return float((values["bf16"] - values["fp32"]).abs().mean())


def bench_step(name: str, make: Callable[[str], Any], finetune: str, options: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rollgym.train.trainers.grpo_config import GRPOConfig
    from rollgym.train.trainers.grpo_loss import LossConfig
    from rollgym.train.trainers.grpo_trainer import PolicyTrainer

    device = options.device
    gc.collect()  # the previous configuration's model and optimizer
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    model = make(device)
    if finetune == "lora":
        model = with_lora(model)
    # On CUDA the trainer's defaults (bf16 autocast with TF32, compile and micro-batches picked from memory)
    # unless --compile / --no-compile / --micro-batch-tokens say otherwise.
    args = GRPOConfig(finetune=finetune, learning_rate=1e-6, precision=None if device == "cuda" else "fp32",
                      micro_batch_tokens=options.micro_batch_tokens, seq_len=options.seq_len,
                      gradient_checkpointing=options.gradient_checkpointing, compile=options.compile,
                      loss=LossConfig(mask_low=None, mask_high=None))
    trainer = PolicyTrainer(args, base_model=name)
    trainer.use_model(model)
    if options.masked_attention and trainer.varlen:  # the SDPA path with a block-diagonal mask, to compare
        trainer.module.causal().set_attn_implementation("sdpa")
        trainer.varlen = False
    vocab = trainer.module.causal().config.vocab_size
    batch = synthetic_batch(vocab, options.rollouts, options.prompt, options.completion)
    gap = bf16_gap(trainer, batch[:2]) if finetune == "full" else None

    def step() -> None:
        trainer.train_batch(batch)
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(options.warmup):  # the allocator, kernels, AdamW's state (on the CPU the first two are slow)
        step()
    times = []
    for _ in range(options.steps):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    seconds = sorted(times)[len(times) // 2]  # the median step: a shared machine's other work shows as outliers
    if options.profile:  # one more step under the profiler: the operators that take the device's time
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities) as profiler:
            step()
        sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
        print(f"## {name} {finetune}: one step's operators by {sort}")
        print(profiler.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    tokens = sum(seq.length for seq in batch)
    peak = peak_flops(device)
    flops = model_flops(trainer.model, batch, full=finetune == "full")
    matmul_flops = model_flops(trainer.model, batch, full=finetune == "full", attention=False)
    tt_flops = torchtitan_flops(trainer.model, batch, options.seq_len)
    row = {"model": name, "finetune": finetune, "params": sum(p.numel() for p in trainer.model.parameters()),
           "tokens": tokens, "step_s": seconds, "tokens_s": tokens / seconds,
           "mfu": flops / seconds / peak if peak else None, "peak_gib": peak_memory(device),
           "mfu_no_attention": matmul_flops / seconds / peak if peak else None,
           "mfu_torchtitan": tt_flops / seconds / peak if peak else None,
           "settings": trainer.settings.why, "state_gib": state_estimate(trainer.model) / 2**30, "bf16_gap": gap,
           "estimate_gib": (state_estimate(trainer.model)
                            + activation_estimate(trainer.model, trainer.settings.micro_batch_tokens,
                                                  options.completion / (options.prompt
                                                                                                 + options.completion)))
           / 2**30}
    del trainer, model
    return row


def step_benchmark(options: argparse.Namespace) -> None:
    import torch

    if options.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch finds no CUDA device")
    if options.threads:
        torch.set_num_threads(options.threads)
    import transformers

    transformers.logging.disable_progress_bar()
    # The random model first: it needs no conversion (the bundled GGUF's takes a minute the first time).
    makers = {"qwen-1.5b" if options.device == "cuda" else "qwen-tiny": random_model, "bundled": bundled_model}
    card = torch.cuda.get_device_name() if options.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    rows = f"packed into rows of {options.seq_len}" if options.seq_len else "one per row"
    if options.seq_len and options.device == "cuda":
        rows += ", masked SDPA attention" if options.masked_attention else ", varlen flash attention"
    print(f"# grpo trainer step on {card}: {options.rollouts} rollouts of {options.prompt}+{options.completion} "
          f"tokens, {rows}, micro-batches of {options.micro_batch_tokens or 'the trainer-picked'} tokens, "
          f"{options.steps} timed steps "
          f"after {options.warmup} "
          f"({'bf16 autocast' if options.device == 'cuda' else 'fp32'}, fp32 master weights)")
    print("MFU: 6·N + 6·L·d·T per rollout of T tokens + 6·V·d per loss token (LoRA: 4·N, 4·V·d); -attn: without "
          "6·L·d·T; tt: 6·N' + 12·L·d·S per token (torchtitan's, prime-rl's perf.py); per GPU")
    print(f"{'model':<10} {'finetune':<8} {'params':>9} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'-attn':>6} {'tt':>6} "
          f"{'peak GiB':>9} {'state GiB':>9} {'est. GiB':>9} {'bf16 |Δ|':>9}")
    for name, make in makers.items():
        if options.models and name not in options.models:
            continue
        for finetune in ("lora", "full"):
            row = bench_step(name, make, finetune, options)
            mfu, no_attention, titan = (f"{row[key]:.1%}" if row[key] is not None else "n/a"
                                        for key in ("mfu", "mfu_no_attention", "mfu_torchtitan"))
            gap = f"{row['bf16_gap']:.4f}" if row["bf16_gap"] is not None else "-"
            print(f"{name:<10} {finetune:<8} {row['params'] / 1e6:>8.1f}M {row['step_s']:>8.3f} "
                  f"{row['tokens_s']:>10.0f} {mfu:>6} {no_attention:>6} {titan:>6} {row['peak_gib']:>9.2f} {row['state_gib']:>9.2f} "
                  f"{row['estimate_gib']:>9.2f} {gap:>9}",
                  flush=True)
            print(f"  {name} {finetune}: {row['settings']}", flush=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="a run folder to report (without --device)")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="benchmark the trainer's step on this device")
    parser.add_argument("--models", nargs="*", help="bundled, qwen-1.5b (cuda) / qwen-tiny (cpu); default: both")
    parser.add_argument("--rollouts", type=int, help="rollouts per batch (default: 16 on cuda, 4 on cpu)")
    parser.add_argument("--prompt", type=int, help="prompt tokens per rollout (default: 256 cuda, 16 cpu)")
    parser.add_argument("--completion", type=int, help="completion tokens per rollout (default: 1792 cuda, 48 cpu)")
    parser.add_argument("--seq-len", type=int, help="packed rows of this many tokens (default: 4096 cuda, 128 cpu; "
                        "0: one rollout per row)")
    parser.add_argument("--micro-batch-tokens", type=int, help="default: the trainer's pick on cuda "
                        "(step_settings); --seq-len, or 4096 on cpu")
    parser.add_argument("--steps", type=int, help="timed steps after the warm-up, their median reported "
                        "(default: 3 cuda, 5 cpu)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile each "
                        "decoder layer (the trainer's compile; default: its default, on cuda yes); the warm-up "
                        "steps compile")
    parser.add_argument("--profile", action="store_true", help="print each configuration's top operators")
    parser.add_argument("--masked-attention", action="store_true",
                        help="packed rows through SDPA with a block-diagonal mask instead of the varlen kernel")
    parser.add_argument("--threads", type=int)
    options = parser.parse_args(argv)
    if options.device is None:
        if options.run:
            report(Path(options.run))
        else:
            phase_breakdown()
        return 0
    cuda = options.device == "cuda"
    options.rollouts = options.rollouts or (16 if cuda else 4)
    options.prompt = options.prompt or (256 if cuda else 16)
    options.completion = options.completion or (1792 if cuda else 48)
    options.seq_len = (4096 if cuda else 128) if options.seq_len is None else (options.seq_len or None)
    options.micro_batch_tokens = options.micro_batch_tokens or (None if cuda else options.seq_len or 4096)
    options.steps = options.steps or (3 if cuda else 5)
    step_benchmark(options)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
