"""Data parallel without redundant passes: over 2 gloo processes each computes π_old and the reference
logprobs for its own shard of the batch only (the sequences its optimizer steps take), counted forward pass
by forward pass, and the step is the one process's step (loss, weights after it). A LoRA (DDP: the inner module
runs, no collective) with mini_batches 2 and kl_beta > 0; full weights (FSDP2: every process runs as many
passes as the busiest) with mini_batches 2, whose checkpoint each process writes its shard of (DCP) and from
which new trainers resume exactly. On CUDA the precision defaults to bf16 with TF32, on a CPU to fp32."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch.multiprocessing as mp  # noqa: E402

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence  # noqa: E402

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
SETTINGS = {"lora": {"lora": LORA, "mini_batches": 2, "loss": {"kl_beta": 0.1}},
            "full": {"finetune": "full", "mini_batches": 2}}


def batch(count: int = 8) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(5)
    out = []
    for i in range(count):
        ids = torch.randint(0, 40, (4 + 5 + i % 3,), generator=generator).tolist()
        logprobs = (-3.7 + (torch.rand(5 + i % 3, generator=generator) - 0.5) * 0.6).tolist()
        out.append(TrainSequence(ids[:4], ids[4:], [1] * len(logprobs), logprobs, advantage=[1.0, -1.0][i % 2],
                                 temperature=1.0))
    return out


def step(kind: str, model: str) -> tuple[PolicyTrainer, dict[str, float], list[list[int]]]:
    """One train_batch of `batch()`, with each no-gradient forward pass's sequences recorded (by prompt)."""
    trainer = PolicyTrainer(GRPOConfig(learning_rate=1e-2, micro_batch_tokens=24, **SETTINGS[kind]), model, seed=1)
    trainer.load(None)
    passes: list[list[int]] = []
    forward = trainer._forward

    def counting(tensors, module=None):
        if not torch.is_grad_enabled():
            passes.append(tensors["input_ids"][:, :4].tolist())
        return forward(tensors, module)

    trainer._forward = counting
    metrics = trainer.train_batch(batch())
    return trainer, metrics, passes


def worker(rank: int, model: str, port: int, out: str) -> None:
    """One of 2 processes: the step of each setting, what it forwarded without gradient, the weights after."""
    os.environ.update(WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    for kind in SETTINGS:
        trainer, metrics, passes = step(kind, model)
        weights = {name: value.detach().clone() for name, value in trainer.model.named_parameters()}
        if trainer.sharded:  # FSDP2: the full weights, gathered
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            weights = {name.removeprefix("lm."): value for name, value in get_model_state_dict(
                trainer.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True)).items()}
        torch.save({"metrics": metrics, "passes": passes, "own": trainer._own(batch()), "weights": weights},
                   Path(out) / f"{kind}-rank{rank}.pt")
        if kind == "full":  # a sharded checkpoint, resumed by new trainers: their next step is the same one
            trainer.save_checkpoint(Path(out) / "checkpoint")
            resumed = PolicyTrainer(trainer.args, model, seed=1)
            resumed.load(str(Path(out) / "checkpoint" / "model"))
            after = [each.train_batch(batch()[::-1]) for each in (trainer, resumed)]
            torch.save({"after": after, "equal": all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(
                trainer.model.parameters(), resumed.model.parameters()))}, Path(out) / f"resume-rank{rank}.pt")
    torch.distributed.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_each_process_computes_pi_old_and_the_reference_on_its_own_shard(tiny_model, tmp_path) -> None:
    mp.start_processes(worker, args=(tiny_model, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    prompts = [seq.prompt_ids for seq in batch()]
    for kind in SETTINGS:
        single, metrics, single_passes = step(kind, tiny_model)
        assert single.precision == "fp32" and single.args.precision is None  # unset: fp32 on a CPU
        no_grad_sets = 2 if kind == "lora" else 1  # π_old (mini_batches 2) and, under kl_beta, the reference
        assert sorted(p for one in single_passes for p in one) == sorted(prompts * no_grad_sets)
        ranks = [torch.load(tmp_path / f"{kind}-rank{rank}.pt", weights_only=False) for rank in range(2)]
        owns = [[prompts[i] for i in rank["own"]] for rank in ranks]
        assert sorted(owns[0] + owns[1]) == sorted(prompts) and owns[0] and owns[1]  # the shards split the batch
        for rank, own in zip(ranks, owns):
            seen = [prompt for one in rank["passes"] for prompt in one]
            if kind == "lora":  # exactly its own sequences, once for π_old and once for the reference
                assert sorted(seen) == sorted(own * no_grad_sets), kind
            else:  # its own, plus filler passes (discarded) to match the busiest process's count
                assert all(prompt in seen for prompt in own) and len(rank["passes"]) == len(ranks[0]["passes"])
                assert len(seen) < len(prompts)
            assert rank["metrics"]["loss"] == pytest.approx(metrics["loss"], rel=1e-5, abs=1e-7), kind
            assert rank["metrics"]["kl"] == pytest.approx(metrics["kl"], rel=1e-5, abs=1e-9), kind
        expected = {name: value.detach() for name, value in single.model.named_parameters()}
        for name, value in ranks[0]["weights"].items():
            assert torch.allclose(value, expected[name], atol=1e-6, rtol=1e-4), (kind, name)
    # The sharded checkpoint: each process wrote its part of AdamW's state, none was gathered to rank 0, and
    # trainers resumed from it take exactly the next step of the ones that went on.
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["sharded"] and state["optimizer"] is None and state["step"] == 2
    assert len(list((tmp_path / "checkpoint" / "optimizer").glob("*.distcp"))) == 2
    for rank in range(2):
        resume = torch.load(tmp_path / f"resume-rank{rank}.pt", weights_only=False)
        assert resume["equal"] and resume["after"][0] == resume["after"][1]


def test_on_cuda_the_group_binds_the_ranks_gpu_and_precision_defaults_to_bf16(monkeypatch) -> None:
    """torch's CUDA calls stand in (no GPU here): the process group is joined with device_id, and an unset
    precision resolves to bf16 on CUDA, fp32 on a CPU; a given one is kept."""
    import torch.distributed as dist

    from rollgym.train.trainers.distributed import DistInfo

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **options: calls.append((backend, options)))
    DistInfo().init()
    assert calls == [("nccl", {"device_id": torch.device("cuda:1")})]
    assert GRPOConfig().precision_on("cuda") == "bf16" and GRPOConfig().precision_on("cpu") == "fp32"
    assert GRPOConfig(precision="fp32").precision_on("cuda") == "fp32"
