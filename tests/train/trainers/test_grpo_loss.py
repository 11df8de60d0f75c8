"""The RL objective (rollgym.train.trainers.grpo_loss) against a reference computed here from first principles, on a
tiny random causal LM: the loss value and every parameter's gradient match, the behaviour ratio is
not 1 when sampling and trainer logprobs differ, and the clip, the truncation and the sequence mask
act exactly on the tokens and rollouts they should."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollgym.train.trainers.grpo_loss import LossConfig, policy_loss, sequence_scales  # noqa: E402
from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence  # noqa: E402


def tiny_model_dir(tmp_path, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    return str(folder)


def make_batch(seed: int = 1) -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(seed)
    batch = []
    for i, (prompt, completion) in enumerate([(5, 6), (3, 9), (7, 4), (4, 7)]):
        ids = torch.randint(0, 40, (prompt + completion,), generator=generator).tolist()
        mask = [1] * completion
        mask[2] = 0  # an environment token inside the completion
        batch.append(TrainSequence(ids[:prompt], ids[prompt:], mask, [0.0] * completion,
                                   advantage=[1.0, -0.5, 0.8, -1.2][i], temperature=0.7))
    return batch


def reference_loss(model, batch, sampled, old, config: LossConfig, temperature: float):
    """Σ_i Σ_t m·L·s_i token by token, with the model's ordinary full forward pass."""
    counts = [s.loss_tokens for s in batch]
    if config.aggregation == "token_mean":
        scales = [1 / sum(counts)] * len(batch)
    elif config.aggregation == "sequence_mean":
        scales = [1 / (len(batch) * n) for n in counts]
    else:
        scales = [1 / (len(batch) * config.max_tokens)] * len(batch)
    total = 0.0
    for i, seq in enumerate(batch):
        ids = torch.tensor([seq.prompt_ids + seq.completion_ids])
        logits = model(input_ids=ids).logits[0] / temperature
        logps = torch.log_softmax(logits, dim=-1)
        tokens = [(j, logps[len(seq.prompt_ids) + j - 1, tok]) for j, tok in enumerate(seq.completion_ids)
                  if seq.loss_mask[j]]
        log_rhos = [old[i][k] - sampled[i][k] for k in range(len(tokens))]
        geometric = math.exp(sum(log_rhos) / len(log_rhos))
        if not (config.mask_low <= geometric <= config.mask_high):
            continue
        for k, (_, logp) in enumerate(tokens):
            weight = min(math.exp(log_rhos[k]), config.tis_cap)
            ratio = torch.exp(logp - old[i][k])
            a = seq.advantage
            clipped = torch.clamp(ratio, 1 - config.clip_low, 1 + config.clip_high)
            term = torch.minimum(ratio * a, clipped * a)
            if a < 0 and config.dual_clip is not None:
                term = torch.maximum(term, torch.tensor(config.dual_clip * a))
            total = total - weight * term * scales[i]
    return total


def trainer_for(tmp_path, **loss) -> PolicyTrainer:
    args = GRPOConfig(finetune="full", learning_rate=1e-3, loss=LossConfig(**loss))
    trainer = PolicyTrainer(args, tiny_model_dir(tmp_path))
    trainer.load(None)
    return trainer


def trainer_loss(trainer: PolicyTrainer, batch, sampled, old, config):
    scales = sequence_scales([s.loss_tokens for s in batch], config)
    tensors = trainer._tensors(batch)
    logprobs = trainer._forward(tensors)
    flat_sampled = torch.tensor([x for row in sampled for x in row])
    flat_old = torch.tensor([x for row in old for x in row])
    token_scales = torch.tensor([scales[r] for r in tensors["rollout"].tolist()])
    return logprobs, policy_loss(logprobs, flat_old, flat_sampled, tensors["advantages"], tensors["rollout"],
                                 token_scales, config)


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_loss_and_gradients_match_the_reference(tmp_path, aggregation) -> None:
    config = LossConfig(aggregation=aggregation, max_tokens=12 if aggregation == "constant" else None)
    trainer = trainer_for(tmp_path, **config.model_dump())
    batch = make_batch()
    with torch.no_grad():
        current, _ = trainer_loss(trainer, batch, [[0.0] * s.loss_tokens for s in batch],
                                  [[0.0] * s.loss_tokens for s in batch], config)
    current = current.tolist()
    rows, start = [], 0
    for seq in batch:
        rows.append(current[start:start + seq.loss_tokens])
        start += seq.loss_tokens
    # π_old: the current policy nudged (as after an earlier update), so the PPO ratio is not 1 and
    # clips where |log r| is large; μ: π_old shifted per token, so ρ ≠ 1, a few tokens beyond the cap,
    # and rollout 2 far enough off that its geometric mean leaves [0.5, 2] and it is masked whole.
    shifts = [0.4, -0.35, 0.05, 0.3, -0.02, 0.25, -0.3, 0.1, 0.0]
    old = [[x + shifts[(i + k) % len(shifts)] for k, x in enumerate(row)] for i, row in enumerate(rows)]
    sampled = [[x - (0.9 if k % 3 == 0 else -0.2) for k, x in enumerate(row)] for row in old]
    sampled[2] = [x - 1.2 for x in old[2]]

    logprobs, terms = trainer_loss(trainer, batch, sampled, old, config)
    terms.loss.backward()
    ours = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()
    reference = reference_loss(trainer.model, batch, sampled, old, config, temperature=0.7)
    reference.backward()

    assert float(terms.loss.detach()) == pytest.approx(float(reference.detach()), rel=1e-5, abs=1e-7)
    assert ours and all(torch.allclose(ours[n], p.grad, rtol=1e-4, atol=1e-7)
                        for n, p in trainer.model.named_parameters() if n in ours)
    assert terms.rho_min < 1.0 < terms.rho_max  # the sampling policy is not the trainer's: ρ ≠ 1
    assert terms.capped > 0  # exp(0.9) > 2: truncated
    assert terms.clipped > 0  # |log r| = 0.3-0.4 leaves [0.8, 1.28] on the side the advantage points to
    assert terms.masked_rollouts == 1 and terms.masked_tokens == batch[2].loss_tokens


def test_without_correction_or_mask_and_with_equal_logprobs_it_is_the_policy_gradient(tmp_path) -> None:
    config = LossConfig(correction="none", mask_low=None, mask_high=None, aggregation="sequence_mean")
    trainer = trainer_for(tmp_path, **config.model_dump())
    batch = make_batch(seed=3)
    logprobs, _ = trainer_loss(trainer, batch, [[0.0] * s.loss_tokens for s in batch],
                               [[0.0] * s.loss_tokens for s in batch], config)
    sampled = logprobs.detach()
    tensors = trainer._tensors(batch)
    scales = sequence_scales([s.loss_tokens for s in batch], config)
    token_scales = torch.tensor([scales[r] for r in tensors["rollout"].tolist()])
    terms = policy_loss(logprobs, sampled, sampled, tensors["advantages"], tensors["rollout"], token_scales, config)
    # r = 1, w = 1: the loss is −Σ s_i A_i, and its gradient is −Σ s_i A_i ∇log π (REINFORCE with a baseline).
    expected = -sum(scales[i] * s.advantage * s.loss_tokens for i, s in enumerate(batch))
    assert float(terms.loss.detach()) == pytest.approx(expected, rel=1e-5)
    assert terms.clipped == 0 and terms.capped == 0 and terms.masked_tokens == 0
    assert terms.rho_sum == pytest.approx(terms.tokens)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="aggregation: constant needs max_tokens"):
        LossConfig(aggregation="constant")
    with pytest.raises(ValueError, match="mask_low 2.0 must be below mask_high 1.5"):
        LossConfig(mask_low=2.0, mask_high=1.5)


def test_the_dual_clip_bounds_negative_advantages_by_hand() -> None:
    """Two tokens of one rollout with A = −1, π_old = μ (w = 1), scale 1: r = 5 lies beyond the dual clip
    (3), r = 2 inside it. By hand: S = max(min(−r, −1.28), −3), so L = 3 + 2 = 5; ∂L/∂log π = 0 for the
    first token (the bound is a constant) and r·|A| = 2 for the second. Without the dual clip, L = 7
    and the first token's gradient is 5."""
    old = torch.zeros(2)
    for dual_clip, loss, grads, clipped in ((3.0, 5.0, [0.0, 2.0], 1), (None, 7.0, [5.0, 2.0], 0)):
        logprobs = torch.tensor([math.log(5.0), math.log(2.0)], requires_grad=True)
        config = LossConfig(dual_clip=dual_clip, mask_low=None, mask_high=None)
        terms = policy_loss(logprobs, old, old, torch.tensor([-1.0, -1.0]), torch.tensor([0, 0]), torch.ones(2), config)
        terms.loss.backward()
        assert float(terms.loss) == pytest.approx(loss, rel=1e-6)
        assert logprobs.grad.tolist() == pytest.approx(grads, rel=1e-6)
        assert terms.clipped == clipped


def test_log_ratios_are_clamped_before_exp() -> None:
    """A token whose log-ratio is 200 (π_old all but ruled it out) gives exp(20), not inf, and a behaviour
    log-ratio of 200 a finite ρ: the loss and its gradient stay finite."""
    logprobs = torch.tensor([200.0, 0.0], requires_grad=True)
    sampled = torch.tensor([0.0, -200.0])
    config = LossConfig(dual_clip=None, correction="none", mask_low=None, mask_high=None)
    terms = policy_loss(logprobs, torch.zeros(2), sampled, torch.tensor([-1.0, -1.0]), torch.tensor([0, 1]),
                        torch.ones(2), config)
    terms.loss.backward()
    assert float(terms.loss) == pytest.approx(math.exp(20.0) + 1.0, rel=1e-5)
    assert math.isfinite(terms.rho_sum) and terms.rho_max == pytest.approx(math.exp(20.0), rel=1e-5)
    assert torch.isfinite(logprobs.grad).all()


def test_the_dual_clip_must_exceed_one() -> None:
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.9)
