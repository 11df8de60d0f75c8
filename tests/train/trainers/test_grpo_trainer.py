"""rollgym's RL trainer on a tiny random causal LM: a resumed trainer holds exactly the state it saved
and takes exactly the step the uninterrupted one takes; one and two data-parallel processes (torchrun,
gloo) take the same step; the long-lived process keeps its model between steps, fails a step with its
cause, and starts again after a crash; distributions it cannot rebuild are refused by name."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import orjson
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, sequences_of  # noqa: E402
from rollgym.train.trainers.grpo_process import LongLivedTrainer  # noqa: E402
from rollgym.train.trainers.base import TrainConfig, TrainingFailed  # noqa: E402

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def groups(seed: int, count: int = 2, size: int = 3, temperature: float = 1.0) -> list[dict]:
    """Curated GRPO groups as curation.to_groups writes them, with made-up tokens and sampling logprobs."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for g in range(count):
        prompt = torch.randint(0, 40, (5,), generator=generator).tolist()
        rollouts = []
        for i in range(size):
            completion = torch.randint(0, 40, (6,), generator=generator).tolist()
            # Near a random 40-token model's own logprobs (about −log 40), so ρ stays near 1.
            logprobs = (-3.7 + (torch.rand(6, generator=generator) - 0.5) * 0.6).tolist()
            rollouts.append({"rollout_id": f"g{g}-r{i}", "reward": float(i % 2), "advantage": [1.0, -1.0, 0.5][i],
                             "sampling": {"temperature": temperature, "top_p": 1.0, "top_k": 0, "logprobs": "processed"},
                             "sequence": {"prompt_ids": prompt, "completion_ids": completion,
                                          "completion_mask": [1, 1, 0, 1, 1, 1], "completion_logprobs": logprobs}})
        out.append({"group_id": f"g{g}", "rollouts": rollouts})
    return out


def adapter_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_resumed_trainer_restores_the_saved_state_and_takes_the_same_next_step(tiny_model, tmp_path) -> None:
    args = GRPOConfig(learning_rate=1e-2, lora=LORA, warmup_steps=2, lr_decay="cosine", total_steps=6)
    first = PolicyTrainer(args, tiny_model, seed=3)
    first.load(None)
    first.train_records(groups(1))
    first.save_checkpoint(tmp_path / "checkpoint")

    resumed = PolicyTrainer(args, tiny_model, seed=3)
    resumed.load(str(tmp_path / "checkpoint" / "adapter"))
    saved = first.optimizer.state_dict()
    loaded = resumed.optimizer.state_dict()
    assert resumed.step == first.step == 1
    assert loaded["param_groups"] == saved["param_groups"]
    assert set(loaded["state"]) == set(saved["state"]) and saved["state"]
    for key, state in saved["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(loaded["state"][key][name], state[name]), (key, name)
    assert resumed.scheduler.state_dict() == first.scheduler.state_dict()

    before = adapter_weights(first.model)
    assert all(torch.equal(before[n], p) for n, p in adapter_weights(resumed.model).items())
    first_metrics = first.train_records(groups(2))
    resumed_metrics = resumed.train_records(groups(2))
    after_first, after_resumed = adapter_weights(first.model), adapter_weights(resumed.model)
    assert any(not torch.equal(before[n], after_first[n]) for n in before)  # the step changed the adapter
    assert all(torch.equal(after_first[n], after_resumed[n]) for n in after_first)
    assert first_metrics["lr"] == resumed_metrics["lr"] and first_metrics["loss"] == resumed_metrics["loss"]


def step_with(processes: int, finetune: str, tiny_model: str, tmp_path: Path, dataset: Path) -> tuple[dict, dict]:
    trainer = LongLivedTrainer()
    run = tmp_path / f"run-{finetune}-{processes}"
    config = TrainConfig(base_model=tiny_model, output_dir=str(run / "step-001" / "train"), version="s1",
                         run_dir=str(run), args={"learning_rate": 1e-2, "lora": LORA, "processes": processes,
                                                 "finetune": finetune, "threads": 1, "micro_batch_tokens": 24})
    try:
        artefact = trainer.submit(dataset, config).wait(timeout=240)
    finally:
        trainer.close()
    from safetensors.torch import load_file

    weights = "adapter_model.safetensors" if finetune == "lora" else "model.safetensors"
    assert artefact.kind == ("lora" if finetune == "lora" else "full_weights")
    return load_file(str(Path(artefact.uri) / weights)), artefact.metrics


@pytest.mark.parametrize("finetune", ["lora", "full"])  # DDP for a LoRA, FSDP2 for full weights
def test_one_and_two_processes_take_the_same_step(tiny_model, tmp_path, finetune) -> None:
    dataset = tmp_path / "groups.jsonl"
    dataset.write_bytes(b"".join(orjson.dumps(g) + b"\n" for g in groups(5, count=3)))
    one, one_metrics = step_with(1, finetune, tiny_model, tmp_path, dataset)
    two, two_metrics = step_with(2, finetune, tiny_model, tmp_path, dataset)
    assert set(one) == set(two) and one
    # AdamW's first step is about lr·sign(g): float summation order shows where g is near 0 (lr is 1e-2).
    assert all(torch.allclose(one[k], two[k], atol=1e-5, rtol=1e-5) for k in one)
    assert one_metrics["tokens"] == two_metrics["tokens"] == 9 * 5
    assert one_metrics["loss"] == pytest.approx(two_metrics["loss"], rel=1e-5)
    assert one_metrics["grad_norm"] == pytest.approx(two_metrics["grad_norm"], rel=1e-4)


def test_the_long_lived_process_keeps_its_model_fails_a_step_with_its_cause_and_restarts(tiny_model, tmp_path) -> None:
    trainer = LongLivedTrainer()
    good = tmp_path / "good.jsonl"
    good.write_bytes(b"".join(orjson.dumps(g) + b"\n" for g in groups(7)))
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b"".join(orjson.dumps(g) + b"\n" for g in groups(7, temperature=0.5))
                    .replace(b'"processed"', b'"raw"'))

    def config(step: int, init: str | None = None) -> TrainConfig:
        return TrainConfig(base_model=tiny_model, output_dir=str(tmp_path / f"step-{step}" / "train"),
                           version=f"s{step}", init_adapter=init, run_dir=str(tmp_path),
                           args={"learning_rate": 1e-2, "lora": LORA, "threads": 1})

    try:
        first = trainer.submit(good, config(1)).wait(timeout=120)
        pid = trainer.process.pid
        second = trainer.submit(good, config(2, first.uri)).wait(timeout=120)
        assert trainer.process.pid == pid and second.metrics["load_s"] == 0.0  # no reload between steps
        assert second.metrics["optimizer_step"] == 2.0
        # Each optimizer step was reported to the loop's optimize line (trainers/progress.py).
        progress = orjson.loads((tmp_path / "step-2" / "train" / "progress.json").read_bytes())
        assert (progress["step"], progress["steps"]) == (1, 1) and progress["tokens"] > 0
        assert progress["loss"] == pytest.approx(second.metrics["loss"])
        with pytest.raises(TrainingFailed, match=r"raw \(T=1\) logprobs of tokens sampled at temperature 0.5"):
            trainer.submit(bad, config(3, second.uri)).wait(timeout=120)
        assert trainer.process.pid == pid  # a failed step does not take the process down
        job = trainer.submit(good, config(4, second.uri))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TrainingFailed, match="killed by SIGKILL"):
            job.wait(timeout=120)
        # The next step starts a new process, which restores step 2's checkpoint exactly.
        fourth = trainer.submit(good, config(4, second.uri)).wait(timeout=120)
        assert trainer.process.pid != pid and fourth.metrics["optimizer_step"] == 3.0 and fourth.metrics["load_s"] > 0
    finally:
        trainer.close()


def test_distributions_the_trainer_cannot_rebuild_are_refused() -> None:
    truncated = groups(1)
    truncated[0]["rollouts"][1]["sampling"]["top_p"] = 0.9
    with pytest.raises(TrainingFailed, match="rollout g0-r1: sampled with top_p 0.9"):
        sequences_of(truncated)
    unknown = groups(1, temperature=0.7)
    unknown[1]["rollouts"][0]["sampling"].pop("logprobs")
    with pytest.raises(TrainingFailed, match="rollout g1-r0: the server's logprobs are unrecorded logprobs"):
        sequences_of(unknown)
    with pytest.raises(TrainingFailed, match="sampled at temperature 0.7, but optimize.args.temperature is 1.0"):
        sequences_of(groups(1, temperature=0.7), temperature=1.0)


def test_min_p_and_penalties_the_server_recorded_are_refused() -> None:
    data = groups(1)
    data[0]["rollouts"][1]["sampling"]["repetition_penalty"] = 1.1
    with pytest.raises(TrainingFailed, match="rollout g0-r1: sampled with repetition_penalty 1.1"):
        sequences_of(data)
    data[0]["rollouts"][1]["sampling"].update(repetition_penalty=1.0, min_p=0.05)
    with pytest.raises(TrainingFailed, match="rollout g0-r1: sampled with min_p 0.05"):
        sequences_of(data)
    data[0]["rollouts"][1]["sampling"]["min_p"] = 0.0
    assert len(sequences_of(data)[0]) == 3


def test_environment_and_forced_tokens_are_out_of_the_loss() -> None:
    data = groups(1)
    data[0]["rollouts"][0]["sequence"]["completion_forced"] = [1, 0, 0, 0, 1, 0]
    sequence = sequences_of(data)[0][0]
    assert sequence.loss_mask == [0, 1, 0, 1, 0, 1]
    assert sequence.loss_tokens == 3


@pytest.mark.parametrize("objective", ["ppo_tis", "surogate"])
def test_a_token_sampled_under_a_grammar_has_no_behaviour_ratio(tiny_model, objective) -> None:
    # Engines report a constrained token's μ after their grammar's mask (vLLM: log π − log Z) or before it (the
    # embedded model): the trainer takes π_old there, so the step does not depend on which one it was given.
    def step(constrained_logprob: float | None) -> tuple[dict, dict]:
        data = groups(4)
        sequence = data[0]["rollouts"][0]["sequence"]
        if constrained_logprob is not None:
            sequence["completion_constrained"] = [0, 1, 0, 1, 1, 0]
            sequence["completion_logprobs"] = [constrained_logprob if c else x for x, c in
                                               zip(sequence["completion_logprobs"], sequence["completion_constrained"])]
        trainer = PolicyTrainer(GRPOConfig(learning_rate=1e-2, lora=LORA, max_logprob_gap=1.0,
                                           loss={"objective": objective}), tiny_model, seed=5)
        trainer.load(None)
        return trainer.train_records(data), adapter_weights(trainer.model)

    masked_metrics, masked = step(-0.01)      # as a post-mask engine reports it: 3.7 nats above π
    own_metrics, own = step(-9.0)             # any other value
    assert masked_metrics["unratioed_tokens"] == own_metrics["unratioed_tokens"] == 3
    assert all(torch.equal(masked[n], own[n]) for n in masked)
    assert masked_metrics["logprob_gap_mean"] == pytest.approx(own_metrics["logprob_gap_mean"])
    assert masked_metrics["logprob_gap_mean"] < 0.5
    # Unflagged, the same logprobs are a mismatch the guard refuses.
    with pytest.raises(TrainingFailed, match="differ from the trainer's"):
        data = groups(4)
        data[0]["rollouts"][0]["sequence"]["completion_logprobs"][1:5] = [-0.01] * 4
        trainer = PolicyTrainer(GRPOConfig(learning_rate=1e-2, lora=LORA, max_logprob_gap=0.3,
                                           loss={"objective": objective}), tiny_model, seed=5)
        trainer.load(None)
        trainer.train_records(data)


def test_full_weights_gradient_checkpointing_and_bf16_are_settings(tiny_model, tmp_path) -> None:
    data = groups(3)
    plain = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-3), tiny_model)
    plain.load(None)
    recomputed = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-3, gradient_checkpointing=True), tiny_model)
    recomputed.load(None)
    plain_metrics, recomputed_metrics = plain.train_records(data), recomputed.train_records(data)
    # Recomputing activations in the backward pass changes the memory, not the step.
    assert recomputed_metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-6)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(plain.model.parameters(), recomputed.model.parameters()))
    bf16 = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-3, precision="bf16"), tiny_model)
    bf16.load(None)
    bf16_metrics = bf16.train_records(data)
    assert bf16_metrics["grad_norm"] == pytest.approx(plain_metrics["grad_norm"], rel=0.1)
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())  # autocast, fp32 master weights

    # Full weights: every weight trains; the checkpoint is model/ + trainer state; the served GGUF adds weights − base.
    plain.save_checkpoint(tmp_path / "full")
    assert (tmp_path / "full" / "model" / "config.json").is_file()
    restored = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-3), tiny_model)
    restored.load(str(tmp_path / "full" / "model"))
    assert restored.step == 1
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), restored.model.parameters()))
    deltas = plain.merged_deltas()
    assert "model.layers.0.self_attn.q_proj" in deltas and "model.embed_tokens" in deltas
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model).state_dict()
    now = plain.model.state_dict()
    key = "model.layers.1.mlp.down_proj"
    assert torch.allclose(torch.from_numpy(deltas[key]), now[key + ".weight"] - base[key + ".weight"], atol=1e-7)
