"""How fp32 matrix products run on CUDA, set per phase rather than for the whole process.

On Ampere and later cards torch can run fp32 matmuls on TF32 tensor cores (10-bit mantissa). The trainer
wants that for what stays fp32 under its bf16 autocast; a fp32 model server does not: its logprobs would
then miss a fp32 forward pass by ~4e-3. When both share a process (co-locate mode) a global switch set
by one reaches the other, so each phase sets what it needs and restores what it found.

Only `torch.set_float32_matmul_precision` / `get_float32_matmul_precision` are used: torch.compile's
cache key reads the latter, and it raises once the per-backend `fp32_precision` API has been mixed in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

__all__ = ["FULL", "TF32", "fp32_matmuls", "trainer_fp32_matmuls"]

FULL = "highest"  # fp32 matmuls in fp32 (torch's default)
TF32 = "high"  # fp32 matmuls on TF32 tensor cores where the card has them

Mode = Literal["highest", "high"]


@contextmanager
def fp32_matmuls(mode: Mode | None) -> Iterator[None]:
    """Run the block with fp32 matmuls at `mode` (`highest` or `high`), then restore the setting found;
    None leaves it alone."""
    if mode is None:
        yield
        return
    if mode not in (FULL, TF32):
        raise ValueError(f"fp32 matmul mode {mode!r}: one of {FULL!r}, {TF32!r}")
    import torch

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(mode)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def trainer_fp32_matmuls(device_type: str, precision: str | None) -> Mode | None:
    """The trainer's setting for its steps: on CUDA with the default precision (bf16 autocast) TF32 for what
    autocast leaves in fp32; on CUDA with a precision named, full fp32 (`fp32` means fp32); on a CPU
    nothing is changed (there `high` may allow bf16 products)."""
    if device_type != "cuda":
        return None
    return TF32 if precision is None else FULL
