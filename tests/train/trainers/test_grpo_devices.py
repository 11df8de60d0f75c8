"""Where the trainer's tensors live, so that the CPU-only CI catches what would fail on the first CUDA step:
no tensor factory in the loss or the trainer's step runs without naming the batch's device, the
data-parallel reductions run on the process group's device, each process binds its own GPU, the model
is loaded with fp32 master weights, and a checkpoint carries the CUDA RNG state. The `gpu` tests run
the same paths on a real card (skipped without one)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_loss import LossConfig, policy_loss  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence  # noqa: E402

from .device_guard import DefaultDeviceFactories  # noqa: E402

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def batch(seed: int = 1) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(seed)
    out = []
    for i, (prompt, completion) in enumerate([(5, 6), (3, 9), (7, 4), (4, 7)]):
        ids = torch.randint(0, 40, (prompt + completion,), generator=generator).tolist()
        logprobs = (-3.7 + (torch.rand(completion, generator=generator) - 0.5) * 0.6).tolist()
        out.append(TrainSequence(ids[:prompt], ids[prompt:], [1] * completion, logprobs,
                                 advantage=[1.0, -0.5, 0.8, -1.2][i], temperature=1.0))
    return out


def loss_inputs(device: str) -> dict:
    generator = torch.Generator().manual_seed(4)
    count = 9
    logprobs = (-2 + torch.rand(count, generator=generator)).to(device).requires_grad_()
    return dict(logprobs=logprobs, old_logprobs=logprobs.detach() + 0.1,
                sampling_logprobs=(-2 + torch.rand(count, generator=generator)).to(device),
                advantages=torch.tensor([1.0] * 4 + [-1.0] * 5, device=device),
                rollout_index=torch.tensor([0] * 4 + [1] * 5, device=device),
                scales=torch.full((count,), 1 / count, device=device),
                ref_logprobs=(-2 + torch.rand(count, generator=generator)).to(device))


def test_the_loss_makes_no_tensor_on_the_default_device() -> None:
    inputs = loss_inputs("cpu")
    with DefaultDeviceFactories() as guard:
        terms = policy_loss(config=LossConfig(kl_beta=0.1), **inputs)
        terms.loss.backward()
    assert guard.calls == []
    assert terms.tokens == 9 and inputs["logprobs"].grad is not None


def test_a_trainer_step_makes_no_tensor_on_the_default_device(tiny_model) -> None:
    for args in (GRPOConfig(lora=LORA, mini_batches=2, loss=LossConfig(kl_beta=0.1), micro_batch_tokens=24),
                 GRPOConfig(finetune="full", epochs=2.0), GRPOConfig(lora=LORA, seq_len=32, micro_batch_tokens=32)):
        trainer = PolicyTrainer(args, tiny_model)
        trainer.load(None)
        with DefaultDeviceFactories() as guard:
            metrics = trainer.train_batch(batch())
        assert guard.calls == [], args
        assert metrics["tokens"] > 0


@gpu
@pytest.mark.gpu
def test_the_loss_and_a_trainer_step_run_on_cuda(tiny_model) -> None:
    terms = policy_loss(config=LossConfig(kl_beta=0.1), **loss_inputs("cuda"))
    terms.loss.backward()
    assert terms.loss.device.type == "cuda"
    for finetune, seq_len in (("lora", None), ("full", None), ("full", 32)):
        trainer = PolicyTrainer(GRPOConfig(lora=LORA, finetune=finetune, mini_batches=2, seq_len=seq_len,
                                           precision="bf16", compile=False), tiny_model)  # placement, not compile
        trainer.load(None)
        assert next(trainer.model.parameters()).device.type == "cuda"
        assert trainer.train_batch(batch())["tokens"] > 0


def test_the_data_parallel_reductions_run_on_the_process_groups_device(monkeypatch) -> None:
    import torch.distributed as dist

    from rollgym.train.trainers.grpo_trainer import DistInfo

    reduced = []

    def all_reduce(tensor, op):  # two processes that hold the same values
        reduced.append(tensor.device)
        tensor.mul_(2) if op == dist.ReduceOp.SUM else None

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    info = DistInfo()
    with DefaultDeviceFactories() as guard:
        sums = info.all_sum([1.5, 2.0])
        lowest = info.all_min([0.25])
    assert guard.calls == []
    assert sums == [3.0, 4.0] and lowest == [0.25]
    assert reduced == [info.device, info.device]


@gpu
@pytest.mark.gpu
def test_a_nccl_group_reduces_the_trainers_sums(monkeypatch) -> None:
    import torch.distributed as dist

    from rollgym.train.trainers.grpo_trainer import DistInfo

    for key, value in {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29533"}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("nccl")
    try:
        info = DistInfo()
        info.world = 2  # the reductions' own code path; one process sums only its own values
        assert info.all_sum([1.5, 2.0]) == [1.5, 2.0]
    finally:
        dist.destroy_process_group()


def test_each_process_binds_its_own_gpu_before_joining_the_group(monkeypatch) -> None:
    import torch.distributed as dist

    from rollgym.train.trainers.grpo_trainer import DistInfo

    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(("set_device", index)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **_: calls.append(("init", backend)))
    info = DistInfo()
    info.init()
    assert calls == [("set_device", 1), ("init", "nccl")]
    assert info.device == torch.device("cuda:1")


def test_the_policy_is_loaded_with_fp32_master_weights_where_cuda_is_present(tmp_path, monkeypatch) -> None:
    from rollgym.train.trainers.policy import load_base

    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model, _ = load_base(str(tmp_path / "bf16"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_a_checkpoint_carries_the_cuda_rng_state(tiny_model, tmp_path, monkeypatch) -> None:
    """On a GPU the dropout masks come from the CUDA generator: a resumed run must continue its stream.
    Here the CUDA generator is a stand-in that the trainer on a 'cuda' device saves and restores."""
    generators = {"saved": torch.tensor([7, 1, 2], dtype=torch.uint8), "restored": None}
    trainer = PolicyTrainer(GRPOConfig(lora=LORA), tiny_model)
    trainer.load(None)
    trainer.train_batch(batch())
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: generators["saved"])
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: generators.__setitem__("restored", (state, device)))
    trainer.device = torch.device("cuda:0")  # only the RNG calls see it: nothing is trained on it here
    trainer.save_checkpoint(tmp_path / "checkpoint")
    trainer.device = torch.device("cpu")
    state = torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert torch.equal(state["rng"]["cuda"], generators["saved"])
    trainer.device = torch.device("cuda:0")
    trainer._restore_state(tmp_path / "checkpoint")
    restored, device = generators["restored"]
    assert torch.equal(restored, generators["saved"]) and device == torch.device("cuda:0")


@gpu
@pytest.mark.gpu
def test_a_resumed_trainer_continues_the_cuda_rng_stream(tiny_model, tmp_path) -> None:
    trainer = PolicyTrainer(GRPOConfig(lora=LORA, compile=False), tiny_model)
    trainer.load(None)
    trainer.train_batch(batch())
    trainer.save_checkpoint(tmp_path / "checkpoint")
    expected = torch.rand(4, device=trainer.device)
    torch.cuda.manual_seed(123)
    resumed = PolicyTrainer(GRPOConfig(lora=LORA, compile=False), tiny_model)
    resumed.load(str(tmp_path / "checkpoint"))
    assert torch.equal(torch.rand(4, device=resumed.device), expected)


def test_a_step_with_a_non_finite_gradient_is_skipped_and_counted(tiny_model, tmp_path) -> None:
    trainer = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-2), tiny_model)
    trainer.load(None)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    poisoned = batch()
    poisoned[1].advantage = float("nan")
    metrics = trainer.train_batch(poisoned)
    assert metrics["skipped_steps"] == 1 and not torch.isfinite(torch.tensor(metrics["grad_norm"]))
    assert trainer.step == 0 and not trainer.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    trainer.save_checkpoint(tmp_path / "checkpoint")
    assert torch.load(tmp_path / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 0
    metrics = trainer.train_batch(batch())  # the next finite batch steps as usual
    assert metrics["skipped_steps"] == 0 and trainer.step == 1
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_new_stage_starts_its_own_schedule_and_keeps_the_optimizer_moments(tiny_model, tmp_path) -> None:
    """Stage 1 decays linearly to 0 over its 2 steps; stage 2 (other settings: its own learning rate and
    length) starts at its own learning rate, not at stage 1's spent schedule, with stage 1's Adam moments."""
    first = PolicyTrainer(GRPOConfig(lora=LORA, learning_rate=1e-2, lr_decay="linear", total_steps=2,
                                     groups_per_step=1), tiny_model)
    first.load(None)
    data = [{"group_id": f"g{g}", "rollouts": [
        {"rollout_id": f"g{g}-r{i}", "advantage": [1.0, -1.0][i], "sampling": {"temperature": 1.0,
                                                                             "logprobs": "processed"},
         "sequence": {"prompt_ids": seq.prompt_ids, "completion_ids": seq.completion_ids,
                      "completion_mask": [1] * len(seq.completion_ids),
                      "completion_logprobs": seq.sampling_logprobs}}
        for i, seq in enumerate(batch(g)[:2])]} for g in range(2)]
    assert first.train_records(data)["steps"] == 2
    first.save_checkpoint(tmp_path / "stage1")
    moments = {k: v["exp_avg"].clone() for k, v in first.optimizer.state_dict()["state"].items()}

    for decay, lr in (("cosine", 5e-3), ("constant", 3e-3)):
        second = PolicyTrainer(GRPOConfig(lora=LORA, learning_rate=lr, lr_decay=decay, total_steps=3), tiny_model)
        second.load(str(tmp_path / "stage1" / "adapter"))
        assert second.step == 2  # the run's optimizer steps go on counting
        state = second.optimizer.state_dict()["state"]
        assert all(torch.equal(state[k]["exp_avg"], v) for k, v in moments.items())
        assert second.train_batch(batch())["lr"] == pytest.approx(lr)
        assert second.scheduler.get_last_lr()[0] < lr if decay == "cosine" else second.scheduler.get_last_lr()[0] == lr

    same = PolicyTrainer(first.args, tiny_model)  # the same settings: the schedule resumes (here: spent)
    same.load(str(tmp_path / "stage1" / "adapter"))
    assert same.scheduler.get_last_lr()[0] == first.scheduler.get_last_lr()[0] == 0.0


def test_the_trainers_processes_get_their_own_gpus_and_too_few_are_refused_by_key() -> None:
    from pydantic import ValidationError

    from rollgym.train.trainers.base import TrainingFailed
    from rollgym.train.trainers.grpo_process import trainer_environment

    assert trainer_environment(GRPOConfig(processes=4), device_count=0) == {}  # a CPU: nothing to set
    assert trainer_environment(GRPOConfig(processes=2), 4, visible="") == {"CUDA_VISIBLE_DEVICES": "0,1"}
    # Beside a model server on the loop's cuda:0; indices are among the devices the loop sees.
    beside = GRPOConfig(processes=3, devices=[1, 2, 3])
    assert trainer_environment(beside, 4, visible="") == {"CUDA_VISIBLE_DEVICES": "1,2,3"}
    assert trainer_environment(beside, 4, visible="4,5,6,7") == {"CUDA_VISIBLE_DEVICES": "5,6,7"}
    with pytest.raises(TrainingFailed, match=r"optimize\.args\.processes: 8 but this node has 4 CUDA device"):
        trainer_environment(GRPOConfig(processes=8), 4)
    with pytest.raises(TrainingFailed, match=r"optimize\.args\.devices: \[1, 2, 3\] but this node has 2"):
        trainer_environment(beside, 2)
    with pytest.raises(ValidationError, match="2 devices for processes: 3"):
        GRPOConfig(processes=3, devices=[0, 1])
    with pytest.raises(ValidationError, match="distinct device indices"):
        GRPOConfig(processes=2, devices=[1, 1])
