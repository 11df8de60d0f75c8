"""The GRPO trainer's checkpoint: what a step leaves in STEP/train/checkpoint/ and how a new trainer takes
everything back (weights or adapter, AdamW's state, the LR schedule, the step, the RNG states).

    checkpoint/model/ or adapter/     what the server loads (full weights gathered whole; a LoRA's adapter)
    checkpoint/trainer_state.pt       step, scheduler, RNG, AdamW's state (None when sharded)
    checkpoint/optimizer/             sharded: each process's part of AdamW's state (torch.distributed.checkpoint)
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import Any

from .base import TrainingFailed
from .lr_schedule import fresh_schedule, schedule_settings

STATE_FILE = "trainer_state.pt"
OPTIMIZER_SHARDS = "optimizer"  # sharded: each process's part of AdamW's state (torch.distributed.checkpoint)


def save(trainer: Any, folder: Path) -> Path:
    """adapter/ (LoRA) or model/ (full weights) + trainer_state.pt, written beside and renamed into
    place, so a kill leaves either the whole checkpoint or none. Rank 0 writes them; sharded (FSDP),
    every process writes its own shard of AdamW's state into optimizer/ (torch.distributed.checkpoint),
    so nothing of it is gathered, and only the weights the server loads are."""
    import numpy as np
    import torch

    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")  # a name every process knows
    optimizer_state = None if trainer.sharded else trainer.optimizer.state_dict()
    if trainer.dist.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    if trainer.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
        )

        weights = get_model_state_dict(trainer.module, options=StateDictOptions(full_state_dict=True,
                                                                             cpu_offload=True))
        trainer.gathered = {name.removeprefix("lm."): value for name, value in weights.items()}
        trainer.dist.barrier()
        dcp.save({"optimizer": get_optimizer_state_dict(trainer.module, trainer.optimizer)},
                 checkpoint_id=str(partial / OPTIMIZER_SHARDS))
    if trainer.dist.rank == 0:
        target = partial / ("model" if trainer.args.finetune == "full" else "adapter")
        if trainer.sharded:
            trainer.model.save_pretrained(target, state_dict=trainer.gathered)
        else:
            trainer.model.save_pretrained(target)
        torch.save({"step": trainer.step, "optimizer": optimizer_state, "sharded": trainer.sharded,
                    "scheduler": trainer.scheduler.state_dict(), "schedule": schedule_settings(trainer.args),
                    "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                            "numpy": np.random.get_state(),
                            "cuda": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None},
                    }, partial / STATE_FILE)
        shutil.rmtree(folder, ignore_errors=True)
        partial.replace(folder)
    trainer.dist.barrier()
    trainer.checkpoint = str(folder / ("model" if trainer.args.finetune == "full" else "adapter"))
    return folder


def restore(trainer: Any, folder: Path) -> None:
    """Everything but the weights (the trainer loaded those) back from a checkpoint folder: AdamW's state
    (sharded: each process its own part), the schedule (a fresh one when the settings changed), the step
    and the RNG states."""
    import numpy as np
    import torch

    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    if bool(state.get("sharded")) != trainer.sharded:
        raise TrainingFailed(f"{folder}: its optimizer state was saved {'sharded' if state.get('sharded') else 'whole'}"
                             f"; resume it with the same finetune and processes settings")
    if trainer.sharded and state.get("optimizer") is None:  # each process reads its own shard
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        shards = {"optimizer": get_optimizer_state_dict(trainer.module, trainer.optimizer)}
        dcp.load(shards, checkpoint_id=str(folder / OPTIMIZER_SHARDS))
        set_optimizer_state_dict(trainer.module, trainer.optimizer, shards["optimizer"])
    elif trainer.sharded:  # a checkpoint that gathered the optimizer state whole (as rollgym once wrote them)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(trainer.module, trainer.optimizer, state["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        trainer.optimizer.load_state_dict(state["optimizer"])
    if state.get("schedule", schedule_settings(trainer.args)) == schedule_settings(trainer.args):
        trainer.scheduler.load_state_dict(state["scheduler"])
    else:
        trainer.scheduler = fresh_schedule(trainer.optimizer, trainer.args)
    trainer.step = int(state["step"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    if trainer.device.type == "cuda" and state["rng"].get("cuda") is not None:  # dropout on the GPU draws from it
        torch.cuda.set_rng_state(state["rng"]["cuda"], trainer.device)


def checkpoint_of(path: str | None) -> str | None:
    """The checkpoint folder a path belongs to (itself, or the parent of its adapter/ or model/), if any."""
    if not path:
        return None
    folder = Path(path)
    for candidate in (folder, folder.parent):
        if (candidate / STATE_FILE).is_file():
            return str(candidate)
    return None


__all__ = ["OPTIMIZER_SHARDS", "STATE_FILE", "checkpoint_of", "restore", "save"]
