"""Sharded full weights in bf16 use FSDP2's mixed precision: the decoder layers compute with bf16 weights
(all-gathered in bf16 from fp32 master shards), the gradients and AdamW's master weights stay fp32, the
sampling temperatures reach the softmax in fp32, and the step is the one-process bf16 (autocast) step
within bf16 rounding. In fp32 nothing is cast."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.multiprocessing as mp  # noqa: E402

from rollgym.train.trainers import token_logprobs  # noqa: E402
from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer  # noqa: E402

from .hsdp_worker import batch  # noqa: E402

SETTINGS = {"finetune": "full", "learning_rate": 1e-3, "micro_batch_tokens": 24}


def seen_dtypes(trainer: PolicyTrainer) -> dict[str, str]:
    """The dtype of a decoder layer's weight as its forward sees it, of the master weight, of its gradient
    after the step's backward, and of the temperatures the softmax divides by."""
    seen: dict[str, str] = {}
    layer = trainer.model.model.layers[0]
    def computing(module, _args) -> None:  # after FSDP's own pre-forward hook: the weights all-gathered
        seen.setdefault("computed", str(module.mlp.up_proj.weight.dtype))

    def stepping(*_args) -> None:
        seen.setdefault("grad", str(layer.mlp.up_proj.weight.grad.dtype))

    layer.register_forward_pre_hook(computing)
    trainer.optimizer.register_step_pre_hook(stepping)
    softmax = token_logprobs._chosen_logprobs

    def recording(logits, targets, temperatures):  # inside the sharded module's forward
        seen.setdefault("temperatures", str(temperatures.dtype))
        return softmax(logits, targets, temperatures)

    token_logprobs._chosen_logprobs = recording
    seen["master"] = str(layer.mlp.up_proj.weight.dtype)
    return seen


def worker(rank: int, model: str, port: int, out: str) -> None:
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results = {}
    for precision in ("bf16", "fp32"):
        trainer = PolicyTrainer(GRPOConfig(**SETTINGS, precision=precision), model, seed=1)
        trainer.load(None)
        seen = seen_dtypes(trainer)
        softmax = token_logprobs._chosen_logprobs
        results[precision] = (trainer.train_batch(batch()), seen)
        token_logprobs._chosen_logprobs = softmax
    if rank == 0:
        torch.save(results, Path(out) / "rank0.pt")
    torch.distributed.destroy_process_group()


def test_sharded_bf16_all_gathers_bf16_weights_and_keeps_fp32_masters_gradients_and_temperatures(
        tiny_model, tmp_path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(worker, args=(tiny_model, port, str(tmp_path)), nprocs=2, start_method="spawn")
    sharded = torch.load(tmp_path / "rank0.pt", weights_only=False)
    metrics, seen = sharded["bf16"]
    assert seen == {"master": "torch.float32", "computed": "torch.bfloat16", "grad": "torch.float32",
                    "temperatures": "torch.float32"}
    assert sharded["fp32"][1] == {"master": "torch.float32", "computed": "torch.float32", "grad": "torch.float32",
                                  "temperatures": "torch.float32"}
    single = PolicyTrainer(GRPOConfig(**SETTINGS, precision="bf16"), tiny_model, seed=1)
    single.load(None)
    autocast = single.train_batch(batch())
    assert metrics["loss"] == pytest.approx(autocast["loss"], rel=2e-2, abs=1e-3)
    assert metrics["grad_norm"] == pytest.approx(autocast["grad_norm"], rel=5e-2)
