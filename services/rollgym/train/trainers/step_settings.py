"""What the trainer's step runs with when the plan leaves it unset: compile and the micro-batch's tokens.

On a CPU: eager, 4096-token micro-batches (as always). On CUDA, what measured best on an H200 with a
Qwen2.5-1.5B-shaped model (docs/train-gpus.md: 25.7 % MFU eager at 4k tokens, 35.7 % compiled at 16k):
each decoder layer compiled, and the largest micro-batch of 16k, 8k or 4k tokens whose estimated peak fits
the device's free memory less a margin. A value the plan gives is kept as it is.

The estimate: what lives across the step (weights, gradients and AdamW's moments of what is trained, all
fp32) plus one micro-batch's saved activations, a round figure per token, hidden unit and layer fitted to
that card's peaks (45.8 GiB eager at 4k, 72.9 GiB compiled at 16k, full weights), plus the softmax's chunk
over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CANDIDATE_TOKENS", "CPU_TOKENS", "Memory", "ModelShape", "StepSettings", "device_memory", "step_settings"]

CPU_TOKENS = 4096
CANDIDATE_TOKENS = (16384, 8192, 4096)  # the largest measured best; none above it was measured
MARGIN = 0.10  # of the device's memory, left to the allocator's fragmentation and the CUDA context
# Saved activations per token, hidden unit and layer (bytes): the 1.5B run's peaks less its fixed memory,
# rounded up (139 eager, 76 compiled: compile fuses the norms, SwiGLU and rotary and saves less).
ACTIVATION_BYTES = {False: 150, True: 85}
TRAINED_BYTES = 16  # a trained parameter: fp32 weight, gradient, AdamW's two moments
FROZEN_BYTES = 4  # an untrained one (LoRA's base): its fp32 weight
LORA_SHARE = 0.01  # LoRA trains about 1 % of the parameters
SOFTMAX_CHUNK_BYTES = 2 * 1024**3  # token_logprobs' fp32 chunk over a 152k vocabulary and its gradient


@dataclass(frozen=True)
class Memory:
    """The device's memory: all of it and what is free now (another process, a co-located KV cache)."""

    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class ModelShape:
    params: int
    hidden: int
    layers: int


@dataclass(frozen=True)
class StepSettings:
    compile: bool
    micro_batch_tokens: int
    why: str  # one line for the trainer's log: what was picked and from what


def peak_bytes(shape: ModelShape, finetune: str, tokens: int, compiled: bool) -> int:
    """The step's estimated peak: fixed state plus one micro-batch's activations."""
    trained = shape.params if finetune == "full" else int(shape.params * LORA_SHARE)
    fixed = trained * TRAINED_BYTES + (shape.params - trained) * FROZEN_BYTES
    return fixed + tokens * shape.hidden * shape.layers * ACTIVATION_BYTES[compiled] + SOFTMAX_CHUNK_BYTES


def step_settings(device_type: str, memory: Memory | None, shape: ModelShape, finetune: str,
                  compile: bool | None, micro_batch_tokens: int | None) -> StepSettings:
    """The step's compile and micro-batch tokens: those given, else the device's defaults (the module's
    docstring). `memory` is needed on CUDA only."""
    if finetune not in ("full", "lora"):
        raise ValueError(f"finetune {finetune!r}: 'full' or 'lora'")
    if device_type != "cuda":
        tokens = micro_batch_tokens or CPU_TOKENS
        return StepSettings(bool(compile), tokens, f"{device_type}: compile {bool(compile)}, {tokens}-token micro-batches")
    if memory is None:
        raise ValueError("step_settings on cuda needs the device's memory")
    compiled = True if compile is None else compile
    if micro_batch_tokens is not None:
        return StepSettings(compiled, micro_batch_tokens, f"cuda: compile {compiled}, {micro_batch_tokens}-token "
                                                          "micro-batches (as given)")
    budget = int(memory.free_bytes - MARGIN * memory.total_bytes)
    tokens = next((t for t in CANDIDATE_TOKENS if peak_bytes(shape, finetune, t, compiled) <= budget),
                  CANDIDATE_TOKENS[-1])
    fits = peak_bytes(shape, finetune, tokens, compiled) <= budget
    return StepSettings(compiled, tokens, (
        f"cuda: compile {compiled}, {tokens}-token micro-batches: est. peak "
        f"{peak_bytes(shape, finetune, tokens, compiled) / 2**30:.1f} GiB of {budget / 2**30:.1f} GiB usable "
        f"({memory.free_bytes / 2**30:.1f} GiB free less {MARGIN:.0%} of {memory.total_bytes / 2**30:.1f} GiB)"
        + ("" if fits else "; even the smallest does not fit the estimate: set micro_batch_tokens or "
                           "gradient_checkpointing")))


def device_memory(device: object) -> Memory | None:
    """A CUDA device's memory, else None."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return Memory(int(total), int(free))
