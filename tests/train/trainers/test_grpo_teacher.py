"""The surogate objective's teacher term (on-policy distillation), worked out by hand on a few tokens:
c = R·(adv_tau·A − kl_tau·log ρ − teacher_tau·(log π_θ − log π_T)), detached; `teacher_kl_sum` is
Σ (log π_θ − log π_T); a positive teacher_tau without teacher logprobs is refused."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from rollgym.train.trainers.grpo_loss import LossConfig, policy_loss  # noqa: E402

LOG = math.log


def run(config: LossConfig, current: list[float], sampled: list[float], teacher: list[float] | None,
        advantages: list[float]):
    logprobs = torch.tensor(current, dtype=torch.float64, requires_grad=True)
    terms = policy_loss(logprobs, logprobs.detach(), torch.tensor(sampled, dtype=torch.float64),
                        torch.tensor(advantages, dtype=torch.float64), torch.zeros(len(current), dtype=torch.long),
                        torch.ones(len(current), dtype=torch.float64), config,
                        teacher_logprobs=None if teacher is None else torch.tensor(teacher, dtype=torch.float64))
    terms.loss.backward()
    return terms, logprobs.grad.tolist()


def test_distillation_alone_pushes_each_token_toward_the_teacher() -> None:
    """adv_tau 0, teacher_tau 1, ρ = 1 (π_θ = μ): c = −(log π_θ − log π_T). The student's −1 against the
    teacher's −3 (it likes the token more): c = −2, the gradient of the loss +2 (log π falls); −2 against −0.5:
    c = 1.5 (log π rises); equal: 0. The advantage does not act."""
    config = LossConfig(objective="surogate", adv_tau=0.0, teacher_tau=1.0)
    terms, grad = run(config, [-1.0, -2.0, -0.7], [-1.0, -2.0, -0.7], [-3.0, -0.5, -0.7], [5.0, 5.0, 5.0])
    assert grad == pytest.approx([2.0, -1.5, 0.0])
    assert float(terms.loss.detach()) == pytest.approx(-(-2.0 + 1.5 + 0.0))
    assert terms.teacher_kl_sum == pytest.approx(2.0 - 1.5 + 0.0) and terms.teacher_tokens == 3


def test_every_term_together_by_hand() -> None:
    """teacher_tau 0.5, adv_tau 1, kl_tau 0.2 at ratio ρ = 2 (log π_θ = log μ + log 2): c = 2·(A − 0.2·log 2 −
    0.5·(log π_θ − log π_T)); ratio_type sequence takes ρ̄ for R (one token: the same)."""
    current, sampled, teacher, advantage = -1.0 + LOG(2), -1.0, -1.5, 0.8
    expected = 2 * (advantage - 0.2 * LOG(2) - 0.5 * (current + 1.5))
    for ratio_type in ("token", "sequence"):
        config = LossConfig(objective="surogate", kl_tau=0.2, teacher_tau=0.5, ratio_type=ratio_type)
        terms, grad = run(config, [current], [sampled], [teacher], [advantage])
        assert grad == pytest.approx([-expected])
        assert terms.teacher_kl_sum == pytest.approx(current - teacher)


def test_teacher_logprobs_are_measured_without_teacher_tau_and_required_with_it() -> None:
    terms, grad = run(LossConfig(objective="surogate"), [-1.0], [-1.0], [-2.0], [1.0])
    assert grad == pytest.approx([-1.0]) and terms.teacher_kl_sum == pytest.approx(1.0)  # no effect on c
    terms, _ = run(LossConfig(), [-1.0], [-1.0], None, [1.0])  # ppo_tis: no teacher term, a zero stat
    assert terms.teacher_kl_sum == 0.0
    with pytest.raises(ValueError, match="teacher_tau > 0 needs the teacher's logprobs"):
        run(LossConfig(objective="surogate", teacher_tau=1.0), [-1.0], [-1.0], None, [1.0])
    with pytest.raises(ValueError, match="teacher_tau is a setting of objective: surogate"):
        LossConfig(objective="ppo_tis", teacher_tau=1.0)


def test_a_token_sampled_under_a_grammar_has_no_teacher_term() -> None:
    """A NaN teacher logprob (a token a grammar restricted, `completion_constrained`): its coefficient has no
    teacher part (here no part at all: adv_tau 0), and teacher_kl_sum and teacher_tokens leave it out."""
    config = LossConfig(objective="surogate", adv_tau=0.0, teacher_tau=1.0)
    terms, grad = run(config, [-1.0, -2.0, -0.7], [-1.0, -2.0, -0.7], [-3.0, math.nan, -0.2], [1.0] * 3)
    assert grad == pytest.approx([2.0, 0.0, -0.5])
    assert terms.teacher_kl_sum == pytest.approx(2.0 - 0.5) and terms.teacher_tokens == 2
