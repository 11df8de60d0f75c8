"""The RL trainer's `kl_beta` and `mini_batches` paths, through PolicyTrainer.train_batch on a tiny random
causal LM, against a reference written here from the model's ordinary forward pass:

- kl_beta: the reference logprobs are the base model's (a fresh copy loaded from disk, no adapter), the
  k3 term β·(exp(q) − q − 1), q = log π_ref − log π_θ, adds its value to the loss and its gradient to every
  LoRA weight's, and the history's `kl` is its mean per token;
- mini_batches: one optimizer step per mini-batch, π_old fixed before the first, so the second mini-batch
  trains on weights the first moved and the PPO clip acts there (loss, clipped tokens and the gradient
  match the reference, the clipped tokens contributing none).

The trainer's gradient is read where it clips it (torch.nn.utils.clip_grad_norm_, wrapped), and the weights
each mini-batch starts from by wrapping `_optimizer_step`; the trainer's code is not changed."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_loss import LossConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence  # noqa: E402

TEMPERATURE = 0.7


def make_batch(advantages: list[float], seed: int = 1) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for i, advantage in enumerate(advantages):
        prompt, completion = 4 + i % 3, 5 + (2 * i) % 5
        ids = torch.randint(0, 40, (prompt + completion,), generator=generator).tolist()
        mask = [1] * completion
        mask[1] = 0  # an environment token inside the completion: out of the loss
        batch.append(TrainSequence(ids[:prompt], ids[prompt:], mask, [0.0] * completion, advantage=advantage,
                                   temperature=TEMPERATURE))
    return batch


def token_logprobs(model, seq: TrainSequence) -> torch.Tensor:
    """log π of the sequence's loss tokens, from the model's full forward pass (logits / temperature)."""
    ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
    logps = torch.log_softmax(model(input_ids=ids).logits[0] / seq.temperature, dim=-1)
    start = len(seq.prompt_ids)
    return torch.stack([logps[start + j - 1, token] for j, token in enumerate(seq.completion_ids)
                        if seq.loss_mask[j]])


def reference_loss(model, batch, old, sampled, config: LossConfig, ref=None):
    """Σ_i Σ_t L_it·s_i (token_mean: s = 1/Σn over this optimizer step's sequences), token by token;
    the loss, the number of tokens the PPO clip (or dual clip) acts on, and Σ k3."""
    scale = 1.0 / sum(seq.loss_tokens for seq in batch)
    total, clipped, kl_sum = torch.zeros(()), 0, 0.0
    for i, seq in enumerate(batch):
        logp = token_logprobs(model, seq)
        log_rho = old[i] - sampled[i]
        geometric = float(log_rho.mean().exp())
        if not config.mask_low <= geometric <= config.mask_high:
            continue
        for t in range(len(logp)):
            weight = min(float(log_rho[t].exp()), config.tis_cap)
            ratio = torch.exp(logp[t] - old[i][t])
            a = seq.advantage
            clipped_ratio = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
            term = torch.minimum(ratio * a, clipped_ratio * a)
            acts = bool(clipped_ratio * a < ratio * a)
            if a < 0 and config.dual_clip is not None and float(term) < config.dual_clip * a:
                term, acts = torch.tensor(config.dual_clip * a), True
            clipped += acts
            per_token = -weight * term
            if ref is not None:
                q = ref[i][t] - logp[t]
                k3 = torch.exp(q) - q - 1
                kl_sum += float(k3.detach())
                per_token = per_token + config.kl_beta * k3
            total = total + per_token * scale
    return total, clipped, kl_sum


class Spy:
    """Records, per optimizer step of the trainer: the sequences it got, a copy of the model it started from,
    its gradient (before clipping, by parameter name) and its metrics."""

    def __init__(self, trainer: PolicyTrainer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.steps: list[dict] = []
        names = {id(p): n for n, p in trainer.model.named_parameters()}
        step = trainer._optimizer_step
        clip = torch.nn.utils.clip_grad_norm_

        def optimizer_step(batch, old, ref):
            self.steps.append({"batch": batch, "model": copy.deepcopy(trainer.model), "ref": ref})
            self.steps[-1]["metrics"] = step(batch, old, ref)
            return self.steps[-1]["metrics"]

        def clip_grad_norm(params, *args, **kwargs):
            params = list(params)
            self.steps[-1]["grads"] = {names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None}
            return clip(params, *args, **kwargs)

        monkeypatch.setattr(trainer, "_optimizer_step", optimizer_step)
        monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_grad_norm)


def gradients(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


def assert_same_gradient(ours: dict, reference: dict) -> None:
    assert set(ours) == set(reference) and ours
    for name, grad in reference.items():
        assert torch.allclose(ours[name], grad, rtol=1e-4, atol=1e-7), name


def test_kl_beta_adds_the_k3_term_to_the_base_model(tiny_model, monkeypatch) -> None:
    beta = 0.5
    config = LossConfig(kl_beta=beta)
    trainer = PolicyTrainer(GRPOConfig(learning_rate=1e-2, lora={"r": 4, "alpha": 8,
                                                                 "target_modules": ["q_proj", "v_proj"]},
                                       loss=config), tiny_model)
    trainer.load(None)
    # LoRA's B starts at zero (the adapter is then the base model, q = 0): move it so that π_θ ≠ π_ref.
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    # A = 0 for two rollouts: their loss and gradient are the k3 term's alone; the others add the PPO term.
    batch = make_batch([0.0, 1.0, 0.0, -0.7])
    base = transformers.LlamaForCausalLM.from_pretrained(tiny_model)
    with torch.no_grad():
        ref = [token_logprobs(base, seq) for seq in batch]
        current = [token_logprobs(trainer.model, seq) for seq in batch]
    for seq, row in zip(batch, current):  # μ = π_θ: ρ = 1, only the KL term and the policy gradient are left
        kept = iter(row.tolist())
        seq.sampling_logprobs = [next(kept) if m else 0.0 for m in seq.loss_mask]
    assert max(float((c - r).abs().max()) for c, r in zip(current, ref)) > 0.05, "the adapter moved nothing"

    spy = Spy(trainer, monkeypatch)
    metrics = trainer.train_batch(batch)
    assert trainer.step == 1 and len(spy.steps) == 1
    step = spy.steps[0]
    assert all(torch.allclose(ours, theirs, atol=1e-5) for ours, theirs in zip(step["ref"], ref))

    model = step["model"]
    loss, _, kl_sum = reference_loss(model, batch, current, current, config, ref)
    tokens = sum(seq.loss_tokens for seq in batch)
    assert metrics["loss"] == pytest.approx(float(loss), rel=1e-5, abs=1e-7)
    assert metrics["kl"] == pytest.approx(kl_sum / tokens, rel=1e-5) and kl_sum > 0
    assert_same_gradient(step["grads"], gradients(model, loss))

    # The k3 term alone, on the rollouts with A = 0: its gradient is β·s·(1 − π_ref/π_θ)·∇log π_θ, by hand.
    alone = [batch[0], batch[2]]
    logp = [token_logprobs(model, seq) for seq in alone]
    by_formula = sum(((1 - torch.exp(r.detach() - lp.detach())) * lp).sum()
                     for r, lp in zip([ref[0], ref[2]], logp)) * beta / tokens
    k3_only, _, _ = reference_loss(model, alone, [current[0], current[2]], [current[0], current[2]],
                                   config.model_copy(update={"aggregation": "token_mean"}), [ref[0], ref[2]])
    assert_same_gradient(gradients(model, k3_only * sum(s.loss_tokens for s in alone) / tokens),
                         gradients(model, by_formula))


def test_kl_beta_with_full_weights_is_refused(tiny_model) -> None:
    from rollgym.train.trainers.base import TrainingFailed

    trainer = PolicyTrainer(GRPOConfig(finetune="full", loss=LossConfig(kl_beta=0.1)), tiny_model)
    trainer.load(None)
    with pytest.raises(TrainingFailed, match="kl_beta > 0 needs finetune: lora"):
        trainer.train_batch(make_batch([1.0, -1.0]))


@pytest.mark.parametrize("mini_batches", [2, 3])
def test_mini_batches_take_one_step_each_and_the_clip_acts_on_the_later_ones(tiny_model, monkeypatch,
                                                                              mini_batches) -> None:
    config = LossConfig()
    # A large learning rate: the first step moves the policy far enough for the later ones' ratios to clip.
    trainer = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=5e-2, mini_batches=mini_batches,
                                       loss=config), tiny_model)
    trainer.load(None)
    batch = make_batch([1.0, -0.8, 0.6, -1.2, 0.9, -0.4])
    start = copy.deepcopy(trainer.model)
    with torch.no_grad():
        old = {id(seq): token_logprobs(start, seq) for seq in batch}
    for seq in batch:  # μ = π_old: ρ = 1
        kept = iter(old[id(seq)].tolist())
        seq.sampling_logprobs = [next(kept) if m else 0.0 for m in seq.loss_mask]

    spy = Spy(trainer, monkeypatch)
    metrics = trainer.train_batch(batch)
    assert trainer.step == mini_batches == len(spy.steps)
    parts = [[id(seq) for seq in step["batch"]] for step in spy.steps]
    assert sorted(i for part in parts for i in part) == sorted(map(id, batch))  # each rollout in one step
    assert all(part for part in parts)

    clipped_later = 0
    for number, step in enumerate(spy.steps):
        part = step["batch"]
        rows = [old[id(seq)] for seq in part]
        loss, clipped, _ = reference_loss(step["model"], part, rows, rows, config)
        tokens = sum(seq.loss_tokens for seq in part)
        ours = step["metrics"]
        assert ours["loss"] == pytest.approx(float(loss), rel=1e-4, abs=1e-6), f"mini-batch {number}"
        assert ours["clip_fraction"] == pytest.approx(clipped / tokens), f"mini-batch {number}"
        assert_same_gradient(step["grads"], gradients(step["model"], loss))
        if number == 0:
            # π_θ = π_old before the first update: r = 1, nothing clipped; its weights are the start's.
            assert clipped == 0
            assert all(torch.equal(a, b) for a, b in zip(step["model"].parameters(), start.parameters()))
        else:
            clipped_later += clipped
            assert not all(torch.equal(a, b) for a, b in zip(step["model"].parameters(), start.parameters()))
    assert clipped_later > 0, "no later mini-batch clipped: the test proves nothing"
    assert metrics["clip_fraction"] == pytest.approx(
        sum(step["metrics"]["clip_fraction"] for step in spy.steps) / mini_batches)
