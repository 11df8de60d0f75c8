"""The `surogate` objective (rollgym.train.trainers.surogate_loss): every key of its specification's `loss`
section against numbers worked out by hand on a few tokens (value, gradient, what each mask counts), the
settings' checks (defaults, a Surogate block pasted in, keys of the other objective refused), and one
trainer step on a tiny random model against the loss written out token by token from its forward pass."""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

from rollgym.train.trainers.grpo_loss import LossConfig, mask_metrics, policy_loss  # noqa: E402

LOG = math.log


def run(config: LossConfig, ratios: list[float], advantages: list[float], rollout: list[int],
        scales: list[float] | None = None, sampled: list[float] | None = None):
    """policy_loss on tokens whose ratio π_θ/μ is given: μ's logprobs are `sampled` (default −1 each) and
    π_θ's log(ratio) above them. Returns the terms and ∂loss/∂log π_θ per token."""
    sampled_t = torch.tensor(sampled if sampled is not None else [-1.0] * len(ratios), dtype=torch.float64)
    logprobs = (sampled_t + torch.tensor([LOG(r) for r in ratios], dtype=torch.float64)).requires_grad_()
    terms = policy_loss(logprobs, logprobs.detach(), sampled_t, torch.tensor(advantages, dtype=torch.float64),
                        torch.tensor(rollout), torch.tensor(scales or [1.0] * len(ratios), dtype=torch.float64),
                        config)
    terms.loss.backward()
    return terms, logprobs.grad.tolist()


def surogate(**keys) -> LossConfig:
    return LossConfig(objective="surogate", **keys)


def test_the_defaults_are_the_specifications() -> None:
    config = LossConfig(objective="surogate")
    assert (config.ratio_type, config.kl_tau, config.adv_tau, config.teacher_tau) == ("token", 0.0, 1.0, 0.0)
    assert (config.token_mask_low, config.token_mask_high, config.geo_mask_low, config.geo_mask_high) == (
        0.125, 8.0, 0.1, 10.0)
    assert (config.sequence_mask_low, config.sequence_mask_high, config.sequence_clip_high) == (0.0, 100.0, 10.0)
    assert LossConfig().objective == "ppo_tis"


def test_token_ratio_coefficient_by_hand() -> None:
    """Three tokens of one rollout, ratios 2, 0.5, 1, A = 1, scale 1: c = ρ·A, so the loss's value is
    −(2 + 0.5 + 1) = −3.5 and its gradient w.r.t. log π_θ is −c = [−2, −0.5, −1] (the coefficient is
    detached: no ρ·∇ρ term, unlike −ρ·A differentiated)."""
    terms, grad = run(surogate(), [2.0, 0.5, 1.0], [1.0] * 3, [0, 0, 0])
    assert float(terms.loss.detach()) == pytest.approx(-3.5)
    assert grad == pytest.approx([-2.0, -0.5, -1.0])
    assert terms.masked_tokens == 0 and terms.clipped == 0 and terms.capped == 0
    assert (terms.rho_min, terms.rho_max, terms.rho_sum) == pytest.approx((0.5, 2.0, 3.5))


def test_adv_tau_and_kl_tau_by_hand() -> None:
    """c = ρ·(adv_tau·A − kl_tau·log ρ). With adv_tau 0.5, kl_tau 0.2, ρ = [2, 0.5], A = [1, −1]:
    c₁ = 2·(0.5 − 0.2·log 2), c₂ = 0.5·(−0.5 + 0.2·log 2)."""
    c1 = 2 * (0.5 - 0.2 * LOG(2))
    c2 = 0.5 * (-0.5 + 0.2 * LOG(2))
    terms, grad = run(surogate(adv_tau=0.5, kl_tau=0.2), [2.0, 0.5], [1.0, -1.0], [0, 0], scales=[0.25, 0.25])
    assert float(terms.loss.detach()) == pytest.approx(-0.25 * (c1 + c2))
    assert grad == pytest.approx([-0.25 * c1, -0.25 * c2])
    # adv_tau 0 and kl_tau > 0: the KL term alone pulls a token with ρ > 1 down and one with ρ < 1 up.
    _, grad = run(surogate(adv_tau=0.0, kl_tau=1.0), [2.0, 0.5], [1.0, -1.0], [0, 0])
    assert grad == pytest.approx([2 * LOG(2), -0.5 * LOG(2)])


def test_token_masks_by_hand() -> None:
    """Ratios 0.1 (< 0.125), 9 (> 8), 1 and 7.9: the first two are out of the loss (no value, no gradient)
    and counted one under each token mask; the rollout's geometric mean (0.1·9·7.9)^¼ ≈ 1.41 keeps the rest."""
    config = surogate()
    terms, grad = run(config, [0.1, 9.0, 1.0, 7.9], [1.0] * 4, [0] * 4)
    assert grad == pytest.approx([0.0, 0.0, -1.0, -7.9])
    assert float(terms.loss.detach()) == pytest.approx(-8.9)
    assert terms.stat("token_masked_low") == 1 and terms.stat("token_masked_high") == 1
    assert terms.masked_tokens == 2 and terms.masked_rollouts == 0
    # Moved thresholds move the masks: [0.05, 10] keeps every token.
    _, grad = run(surogate(token_mask_low=0.05, token_mask_high=10.0), [0.1, 9.0, 1.0, 7.9], [1.0] * 4, [0] * 4)
    assert grad == pytest.approx([-0.1, -9.0, -1.0, -7.9])


def test_geometric_masks_mask_a_sequence_whole() -> None:
    """Rollout 0: ratios 0.2, 0.04 (geometric mean 0.089 < 0.1), rollout 1: 12, 12 (> 10), rollout 2: 1, 1.
    The token masks are moved out of the way: only the geometric ones act, each on a whole rollout."""
    config = surogate(token_mask_low=0.01, token_mask_high=50.0)
    terms, grad = run(config, [0.2, 0.04, 12.0, 12.0, 1.0, 1.0], [1.0] * 6, [0, 0, 1, 1, 2, 2])
    assert grad == pytest.approx([0, 0, 0, 0, -1.0, -1.0])
    assert terms.stat("geo_masked_low") == 1 and terms.stat("geo_masked_high") == 1
    assert terms.masked_rollouts == 2 and terms.masked_tokens == 4
    _, grad = run(surogate(token_mask_low=0.01, token_mask_high=50.0, geo_mask_low=0.05, geo_mask_high=20.0),
                  [0.2, 0.04, 12.0, 12.0, 1.0, 1.0], [1.0] * 6, [0, 0, 1, 1, 2, 2])
    assert grad == pytest.approx([-0.2, -0.04, -12.0, -12.0, -1.0, -1.0])


def test_sequence_masks_by_the_smallest_and_largest_token_ratio() -> None:
    """sequence_mask_low 0.5: rollout 0 (ratios 0.4 and 2; geometric mean 0.89, no token mask) is masked
    whole by its smallest ratio; sequence_mask_high 3: rollout 1 (4 and 0.6) by its largest; rollout 2
    (1, 1) stays. At the defaults (0, 100) neither fires."""
    ratios, rollout = [0.4, 2.0, 4.0, 0.6, 1.0, 1.0], [0, 0, 1, 1, 2, 2]
    terms, grad = run(surogate(sequence_mask_low=0.5, sequence_mask_high=3.0), ratios, [1.0] * 6, rollout)
    assert grad == pytest.approx([0, 0, 0, 0, -1.0, -1.0])
    assert terms.stat("sequence_masked_low") == 1 and terms.stat("sequence_masked_high") == 1
    assert terms.masked_rollouts == 2
    terms, grad = run(surogate(), ratios, [1.0] * 6, rollout)
    assert grad == pytest.approx([-r for r in ratios]) and terms.masked_rollouts == 0
    # The largest ratio above 100 masks at the defaults (token masks moved out of the way).
    terms, _ = run(surogate(token_mask_high=1000.0, geo_mask_high=1000.0), [150.0, 0.5], [1.0, 1.0], [0, 0])
    assert terms.stat("sequence_masked_high") == 1 and terms.masked_tokens == 2


def test_sequence_ratio_is_the_clipped_geometric_mean_by_hand() -> None:
    """ratio_type sequence: every token of a rollout is weighed by ρ̄ = exp(mean log ρ), clipped at
    sequence_clip_high, and the KL term keeps the token's own log ρ. Rollout 0: ratios 2, 8 → ρ̄ = 4;
    rollout 1: 0.5, 0.5 → 0.5. With A = 1, −1 and kl_tau 0.1: c = ρ̄·(A − 0.1·log ρ_t)."""
    config = surogate(ratio_type="sequence", kl_tau=0.1)
    ratios, advantages, rollout = [2.0, 8.0, 0.5, 0.5], [1.0, 1.0, -1.0, -1.0], [0, 0, 1, 1]
    terms, grad = run(config, ratios, advantages, rollout)
    expected = [4 * (1 - 0.1 * LOG(2)), 4 * (1 - 0.1 * LOG(8)),
                0.5 * (-1 - 0.1 * LOG(0.5)), 0.5 * (-1 - 0.1 * LOG(0.5))]
    assert grad == pytest.approx([-c for c in expected])
    assert terms.stat("sequence_clipped") == 0
    # sequence_clip_high 3: rollout 0's ρ̄ = 4 is clipped to 3, and counted.
    terms, grad = run(surogate(ratio_type="sequence", sequence_clip_high=3.0), ratios, advantages, rollout)
    assert grad == pytest.approx([-3.0, -3.0, 0.5, 0.5])
    assert terms.stat("sequence_clipped") == 1
    # ratio_type token with the same clip: it does not act (one ratio per token).
    _, grad = run(surogate(sequence_clip_high=3.0), ratios, advantages, rollout)
    assert grad == pytest.approx([-2.0, -8.0, 0.5, 0.5])


def test_mask_metrics_for_the_history() -> None:
    terms, _ = run(surogate(), [0.1, 9.0, 1.0, 7.9], [1.0] * 4, [0] * 4)
    from rollgym.train.trainers.grpo_loss import STATS

    sums = dict(zip(STATS, terms.stats.tolist()))
    metrics = mask_metrics(sums, 4.0, surogate())
    assert metrics["token_mask_low_fraction"] == 0.25 and metrics["token_mask_high_fraction"] == 0.25
    assert {key for key in metrics if key.endswith("_rollouts")} == {
        "geo_mask_low_rollouts", "geo_mask_high_rollouts", "sequence_mask_low_rollouts",
        "sequence_mask_high_rollouts", "sequence_clipped_rollouts"}
    assert mask_metrics(sums, 4.0, LossConfig()) == {}


def test_a_surogate_block_pastes_in_and_other_keys_are_refused() -> None:
    block = {"ratio_type": "token", "kl_tau": 0.0, "adv_tau": 1.0, "token_mask_low": 0.125, "token_mask_high": 8.0,
             "geo_mask_low": 0.1, "geo_mask_high": 10.0}
    assert LossConfig.model_validate(block).objective == "surogate"  # no `objective` key needed
    assert LossConfig.model_validate({**block, "aggregation": "sequence_mean"}).objective == "surogate"
    with pytest.raises(ValueError, match="clip_low is a setting of objective: ppo_tis, but the objective is surogate"):
        LossConfig.model_validate({**block, "clip_low": 0.1})
    with pytest.raises(ValueError, match="kl_tau is a setting of objective: surogate, but the objective is ppo_tis"):
        LossConfig(objective="ppo_tis", kl_tau=0.1)
    with pytest.raises(ValueError, match="token_mask_low 2.0 must be below token_mask_high 1.0"):
        surogate(token_mask_low=2.0, token_mask_high=1.0)
    with pytest.raises(ValueError, match="ratio_type"):
        surogate(ratio_type="segment")
    # A dumped config (every key present) reads back as itself, under either objective.
    for config in (LossConfig(), surogate(kl_tau=0.3)):
        assert LossConfig.model_validate(config.model_dump()) == config


def test_a_plan_takes_a_surogate_block() -> None:
    from rollgym.train.loop.plan import OptimizeConfig

    args = {"loss": {"ratio_type": "sequence", "kl_tau": 0.01, "adv_tau": 1.0, "teacher_tau": 0.0,
                     "token_mask_low": 0.125, "token_mask_high": 8.0, "geo_mask_low": 0.1, "geo_mask_high": 10.0,
                     "sequence_mask_low": 0.0, "sequence_mask_high": 100.0, "sequence_clip_high": 10.0}}
    OptimizeConfig(trainer="grpo", args=args)


def test_a_trainer_step_matches_the_objective_token_by_token(tiny_model, monkeypatch) -> None:
    """One optimizer step of PolicyTrainer under `surogate` (token ratios, kl_tau > 0) on a tiny model, with
    sampling logprobs set off the model's own so that ρ ≠ 1, one token masked high and one rollout masked by
    its geometric mean: the loss, the gradient of every weight and the history's mask counts equal the
    objective computed here from the model's ordinary forward pass."""
    pytest.importorskip("transformers")
    from rollgym.train.trainers.grpo_config import GRPOConfig
    from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence

    config = surogate(kl_tau=0.05)
    trainer = PolicyTrainer(GRPOConfig(finetune="full", learning_rate=1e-3, loss=config), tiny_model)
    trainer.load(None)
    generator = torch.Generator().manual_seed(2)
    batch = []
    for i, advantage in enumerate([1.0, -0.5, 0.8]):
        ids = torch.randint(0, 40, (5 + 6,), generator=generator).tolist()
        mask = [1] * 6
        mask[1] = 0  # an environment token
        batch.append(TrainSequence(ids[:5], ids[5:], mask, [0.0] * 6, advantage=advantage, temperature=0.7))

    def token_logprobs(model, seq):
        logps = torch.log_softmax(model(input_ids=torch.tensor([seq.prompt_ids + seq.completion_ids])).logits[0]
                                  / seq.temperature, dim=-1)
        return torch.stack([logps[len(seq.prompt_ids) + j - 1, tok] for j, tok in enumerate(seq.completion_ids)
                            if seq.loss_mask[j]])

    with torch.no_grad():
        current = [token_logprobs(trainer.model, seq) for seq in batch]
    shifts = [[0.3, -0.4, 0.2, -2.5, 0.1], [-0.2, 0.25, 0.0, 0.3, -0.1], [2.6, 2.4, 2.5, 2.3, 2.7]]
    sampled = [c - torch.tensor(s) for c, s in zip(current, shifts)]  # log ρ = shift
    for seq, row in zip(batch, sampled):
        kept = iter(row.tolist())
        seq.sampling_logprobs = [next(kept) if m else 0.0 for m in seq.loss_mask]

    grads = {}
    clip = torch.nn.utils.clip_grad_norm_
    names = {id(p): n for n, p in trainer.model.named_parameters()}

    def spy(params, *args, **kwargs):
        params = list(params)
        grads.update({names[id(p)]: p.grad.detach().clone() for p in params if p.grad is not None})
        return clip(params, *args, **kwargs)

    start = copy.deepcopy(trainer.model)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    metrics = trainer.train_batch(batch)

    tokens = sum(seq.loss_tokens for seq in batch)
    total = torch.zeros(())
    for seq, row in zip(batch, sampled):
        logp = token_logprobs(start, seq)
        log_rho = logp.detach() - row
        if not 0.1 <= float(log_rho.mean().exp()) <= 10.0:
            continue  # rollout 2: geometric mean e^2.5 ≈ 12.2
        for t in range(len(logp)):
            rho = float(log_rho[t].exp())
            if not 0.125 <= rho <= 8.0:
                continue  # rollout 0's fourth token: ρ = e^-2.5 ≈ 0.08
            coeff = rho * (seq.advantage - 0.05 * float(log_rho[t]))
            total = total - coeff * (logp[t] - logp[t].detach() + 1.0) / tokens
    start.zero_grad()
    total.backward()
    assert metrics["loss"] == pytest.approx(float(total.detach()), rel=1e-5)
    for name, param in start.named_parameters():
        assert torch.allclose(grads[name], param.grad, rtol=1e-4, atol=1e-7), name
    assert metrics["masked_rollouts"] == 1 and metrics["geo_mask_high_rollouts"] == 1
    assert metrics["token_mask_low_fraction"] == pytest.approx(1 / tokens)
    assert metrics["masked_fraction"] == pytest.approx((1 + batch[2].loss_tokens) / tokens)
    assert metrics["clip_fraction"] == 0 and metrics["tis_capped_fraction"] == 0
