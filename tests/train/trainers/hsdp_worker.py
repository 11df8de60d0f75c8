"""One trainer process of test_grpo_nodes.py's two "nodes", started by torchrun (its rendezvous sets RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE): the model loaded by rank 0 alone and sharded, a full-weight step
on `batch()` recording the gradients (whole, before AdamW applies them), a sharded checkpoint, the next step
(then saved as a step between checkpoints), and a new trainer resumed from that checkpoint taking the same
next step. Global rank 0 writes what it saw to OUT/rank0.pt.

    python -m torch.distributed.run --nnodes 2 --node-rank R ... hsdp_worker.py MODEL OUT
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from rollgym.train.trainers.grpo_config import GRPOConfig
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence

SETTINGS = {"finetune": "full", "learning_rate": 1e-3, "micro_batch_tokens": 24}


def batch(count: int = 12) -> list[TrainSequence]:
    """Rollouts of 9 to 13 tokens (a 40-token vocabulary), advantages ±1."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for i in range(count):
        ids = torch.randint(0, 40, (4 + 5 + i % 5,), generator=generator).tolist()
        logprobs = (-3.7 + (torch.rand(5 + i % 5, generator=generator) - 0.5) * 0.6).tolist()
        out.append(TrainSequence(ids[:4], ids[4:], [1] * len(logprobs), logprobs, advantage=[1.0, -1.0][i % 2],
                                 temperature=1.0))
    return out


def whole(tensor: Any) -> Any:
    """A weight or gradient whole: a sharded one (a DTensor) gathered from every process."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def weights(trainer: PolicyTrainer) -> dict[str, Any]:
    return {name: whole(value) for name, value in trainer.model.named_parameters()}


def recording_gradients(trainer: PolicyTrainer) -> list[dict[str, Any]]:
    """Each optimizer step's gradients, whole, taken just before AdamW's step."""
    seen: list[dict[str, Any]] = []
    trainer.optimizer.register_step_pre_hook(lambda *_: seen.append(
        {name: whole(p.grad) for name, p in trainer.model.named_parameters()}))
    return seen


def loaded_as_on_disk(trainer: PolicyTrainer, model: str) -> dict[str, Any]:
    """How each process loaded the model (its calls of load_base) and whether the sharded model it holds is
    the one on disk: every weight (gathered) and every buffer of every process (rotary frequencies, which
    no state dict carries)."""
    from transformers import AutoModelForCausalLM

    buffers: list[Any] = [None] * trainer.dist.world
    torch.distributed.all_gather_object(buffers, {n: b.clone() for n, b in trainer.model.named_buffers()})
    loads: list[Any] = [None] * trainer.dist.world
    torch.distributed.all_gather_object(loads, LOADS)
    held = weights(trainer)
    disk = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return {"loads": loads,
            "weights": held.keys() == dict(disk.named_parameters()).keys()
            and all(torch.equal(held[n], p) for n, p in disk.named_parameters()),
            "buffers": all(b.keys() == dict(disk.named_buffers()).keys()
                           and all(torch.equal(b[n], v) for n, v in disk.named_buffers()) for b in buffers)}


LOADS: list[str] = []


def counting_loads() -> None:
    from rollgym.train.trainers import policy

    load_base = policy.load_base

    def counted(source: str) -> Any:
        LOADS.append(source)
        return load_base(source)

    policy.load_base = counted


def main(model: str, out: str) -> None:
    torch.set_num_threads(1)
    counting_loads()
    trainer = PolicyTrainer(GRPOConfig(**SETTINGS), model, seed=1)
    trainer.load(None)
    first = next(trainer.model.parameters())
    layout = {"world": trainer.dist.world, "nodes": trainer.dist.nodes, "mesh": tuple(first.device_mesh.shape),
              "mesh_dims": first.device_mesh.mesh_dim_names, "placements": [type(p).__name__ for p in first.placements]}
    loaded = loaded_as_on_disk(trainer, model)
    grads = recording_gradients(trainer)
    metrics = trainer.train_batch(batch())
    stepped = weights(trainer)
    trainer.save_checkpoint(Path(out) / "checkpoint")
    continued = trainer.train_batch(batch()[::-1])
    # A step between checkpoints (checkpoint_every): no optimizer state written, but the weights a merged GGUF
    # is made of are this step's, gathered.
    trainer.save_serving(Path(out) / "between")
    held = weights(trainer)
    gathered_now = trainer.dist.rank != 0 or all(torch.equal(trainer.gathered[n], held[n]) for n in held)
    resumed = PolicyTrainer(trainer.args, model, seed=1)
    resumed.load(str(Path(out) / "checkpoint" / "model"))
    after_resume = resumed.train_batch(batch()[::-1])
    result = {"layout": layout, "loaded": loaded, "metrics": metrics, "grads": grads[0], "weights": stepped,
              "continued": (continued, held), "gathered_now": gathered_now, "resumed": (after_resume, weights(resumed))}
    if trainer.dist.rank == 0:
        torch.save(result, Path(out) / "rank0.pt")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
