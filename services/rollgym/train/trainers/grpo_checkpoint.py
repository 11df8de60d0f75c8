"""The GRPO trainer's checkpoint: what a step leaves in STEP/train/checkpoint/ and how a new trainer takes
everything back (weights or adapter, AdamW's state, the LR schedule, the step, the RNG states).

    checkpoint/model/ or adapter/     what the server loads (full weights gathered whole; a LoRA's adapter)
    checkpoint/trainer_state.pt       step, scheduler, RNG, AdamW's state (None when sharded)
    checkpoint/optimizer/             sharded: each process's part of AdamW's state (torch.distributed.checkpoint)
    checkpoint/serving_only.json      a step between checkpoints (`checkpoint_every`): only what serving reads

A sharded checkpoint may be written in the background: each process stages its part of AdamW's state in
host memory and returns to training while a thread writes it (`dcp.async_save`, on a gloo group of its
own so that its collectives never meet the step's); the folder is renamed into place once every part is
on disk, and the next checkpoint (or the trainer's stop) waits for that first (`settle`).
"""

from __future__ import annotations

import copy
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import orjson

from .base import TrainingFailed
from .lr_schedule import fresh_schedule, schedule_settings

STATE_FILE = "trainer_state.pt"
OPTIMIZER_SHARDS = "optimizer"  # sharded: each process's part of AdamW's state (torch.distributed.checkpoint)
SERVING_ONLY = "serving_only.json"


class Background:
    """A checkpoint being written: this process's part of AdamW's state (a future), and on rank 0 a thread that
    writes the gathered weights and the trainer state, then renames the folder into place once the parts
    are on disk (rank 0's future completes after every process's part and the metadata)."""

    def __init__(self, future: Any, write: Any, partial: Path, folder: Path) -> None:
        self.future = future
        self.error: BaseException | None = None
        self.thread = None
        if write is not None:  # rank 0: the weights and the trainer state too, then the rename
            self.thread = threading.Thread(target=self._place, args=(write, partial, folder), daemon=True)
            self.thread.start()

    def _place(self, write: Any, partial: Path, folder: Path) -> None:
        try:
            write()
            self.future.result()
            shutil.rmtree(folder, ignore_errors=True)
            partial.replace(folder)
        except BaseException as exc:  # noqa: BLE001 - raised where the trainer waits for it (settle)
            self.error = exc

    def wait(self) -> None:
        self.future.result()
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise TrainingFailed(f"the checkpoint written in the background failed: {self.error!r}")


def settle(trainer: Any) -> None:
    """Wait until the checkpoint being written in the background (if any) is in place, on every process."""
    pending, trainer.background = getattr(trainer, "background", None), None
    if pending is not None:
        pending.wait()
        trainer.dist.barrier()


def gather_weights(trainer: Any) -> None:
    """Sharded: the full weights, gathered from every process into host memory on rank 0 (`trainer.gathered`:
    what the checkpoint's model/ and a merged GGUF are made of). A collective: every process calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    weights = get_model_state_dict(trainer.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    trainer.gathered = {name.removeprefix("lm."): value for name, value in weights.items()}


def save_serving(trainer: Any, folder: Path, every: int) -> Path:
    """A step between checkpoints: only what serving reads from disk (a LoRA's adapter; full weights are
    served from memory: apply merged or memory, sharded ones gathered for that) and a note that the step is
    not resumable."""
    settle(trainer)
    if trainer.sharded:
        gather_weights(trainer)
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")
    if trainer.dist.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        if trainer.args.finetune == "lora":
            trainer.model.save_pretrained(partial / "adapter")
        (partial / SERVING_ONLY).write_bytes(orjson.dumps({"step": trainer.step, "checkpoint_every": every}))
        shutil.rmtree(folder, ignore_errors=True)
        partial.replace(folder)
    trainer.dist.barrier()
    trainer.checkpoint = str(folder / ("model" if trainer.args.finetune == "full" else "adapter"))
    return folder


def not_resumable(path: str | None) -> str | None:
    """Why a trainer cannot start from `path` (a step's adapter/ or model/) exactly, if it cannot: a step
    between checkpoints, or a background checkpoint the trainer stopped before it was in place."""
    if not path:
        return None
    folder = Path(path).parent
    if (folder / SERVING_ONLY).is_file():
        every = orjson.loads((folder / SERVING_ONLY).read_bytes()).get("checkpoint_every")
        return (f"{folder} is a step between checkpoints (checkpoint_every {every}): it holds no optimizer state; "
                "resume or rewind the run to a step whose checkpoint has trainer_state.pt")
    if not folder.exists() and folder.with_name(folder.name + ".partial").exists():
        return (f"{folder}: its checkpoint was being written in the background when the trainer stopped "
                f"({folder.name}.partial is incomplete); rewind the run to the step before")
    return None


def save(trainer: Any, folder: Path, background: bool = False) -> Path:
    """adapter/ (LoRA) or model/ (full weights) + trainer_state.pt, written beside and renamed into
    place, so a kill leaves either the whole checkpoint or none. Rank 0 writes them; sharded (FSDP),
    every process writes its own shard of AdamW's state into optimizer/ (torch.distributed.checkpoint),
    so nothing of it is gathered, and only the weights the server loads are; with `background`, that
    write goes on while the trainer returns (the folder appears when it is done)."""
    import numpy as np
    import torch

    settle(trainer)
    folder = Path(folder)
    partial = folder.with_name(folder.name + ".partial")  # a name every process knows
    optimizer_state = None if trainer.sharded else trainer.optimizer.state_dict()
    if trainer.dist.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    if trainer.sharded:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        gather_weights(trainer)
        trainer.dist.barrier()
        shards = {"optimizer": get_optimizer_state_dict(trainer.module, trainer.optimizer)}
        if background:  # staged in host memory here, written by a thread
            written = dcp.async_save(shards, checkpoint_id=str(partial / OPTIMIZER_SHARDS),
                                     process_group=trainer.dist.side_group())
        else:
            dcp.save(shards, checkpoint_id=str(partial / OPTIMIZER_SHARDS))
    write = None
    if trainer.dist.rank == 0:
        # Taken now (the step goes on); written now, or with `background` by the thread, as the gathered
        # weights are a host copy of their own.
        state = {"step": trainer.step, "optimizer": optimizer_state, "sharded": trainer.sharded,
                 "scheduler": copy.deepcopy(trainer.scheduler.state_dict()), "schedule": schedule_settings(trainer.args),
                 "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                         "cuda": torch.cuda.get_rng_state(trainer.device) if trainer.device.type == "cuda" else None}}
        target = partial / ("model" if trainer.args.finetune == "full" else "adapter")
        gathered, model = trainer.gathered, trainer.model

        def write() -> None:
            model.save_pretrained(target, **({"state_dict": gathered} if trainer.sharded else {}))
            torch.save(state, partial / STATE_FILE)

    if background and trainer.sharded:
        trainer.background = Background(written, write, partial, folder)
    else:
        if write is not None:
            write()
            shutil.rmtree(folder, ignore_errors=True)
            partial.replace(folder)
        trainer.dist.barrier()
    trainer.unsaved = None
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


__all__ = ["OPTIMIZER_SHARDS", "SERVING_ONLY", "STATE_FILE", "Background", "checkpoint_of", "gather_weights",
           "not_resumable", "restore", "save", "save_serving", "settle"]
