"""The GRPO trainer's learning-rate schedule: warm-up from 0, then constant, linear or cosine decay to 0 at
`total_steps`; what identifies a schedule (a checkpoint saved under another stage's settings does not continue
its schedule), and a fresh one that keeps the optimizer's moments.
"""

from __future__ import annotations

import math
from typing import Any

from .grpo_config import GRPOConfig


def lr_factor(args: GRPOConfig, step: int) -> float:
    """The learning rate's factor at `step`: warm-up from 0, then constant, linear or cosine decay to 0."""
    if args.warmup_steps and step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    if args.lr_decay == "constant" or not args.total_steps:
        return 1.0
    span = max(1, args.total_steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / span)
    return 1.0 - progress if args.lr_decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_schedule(optimizer: Any, args: GRPOConfig) -> Any:
    """The schedule of `args` over `optimizer`, from its step 0."""
    import torch

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(args, step))


def schedule_settings(args: GRPOConfig) -> dict[str, Any]:
    """What identifies an LR schedule: a checkpoint saved under other settings (the previous stage's)
    does not continue its schedule here."""
    return {"learning_rate": args.learning_rate, "betas": list(args.betas), "weight_decay": args.weight_decay,
            "warmup_steps": args.warmup_steps, "lr_decay": args.lr_decay, "total_steps": args.total_steps}


def fresh_schedule(optimizer: Any, args: GRPOConfig) -> Any:
    """This stage's schedule from its step 0, with its own learning rate, betas and weight decay; the
    optimizer's moments (and AdamW's per-weight step counts) carry on from the checkpoint."""
    for group in optimizer.param_groups:
        group.update(lr=args.learning_rate, initial_lr=args.learning_rate, betas=args.betas,
                     weight_decay=args.weight_decay)
    return lr_schedule(optimizer, args)


__all__ = ["fresh_schedule", "lr_factor", "lr_schedule", "schedule_settings"]
