"""The policy-gradient objective of rollgym's RL trainer (`grpo`), written out in docs/train-objective.md.

For every token t of rollout i that the policy sampled (m_it = 1: a model token, not an environment
token and not one a grammar forced), with A_i the rollout's advantage as the batch computed it:

    log μ_it       the sampling logprob the model server recorded, under the sampling temperature; at a
                   token a grammar restricted (`completion_constrained`) log π_old,it instead (ρ = 1,
                   grpo_batch.behaviour_logprobs says why)
    log π_old,it   the trainer's logprob at the start of this optimizer step (no gradient)
    log π_θ,it     the trainer's logprob now (the one the gradient flows through)

    r_it  = exp(log π_θ − log π_old)                 PPO ratio, clipped to [1 − clip_low, 1 + clip_high]
    ρ_it  = exp(log π_old − log μ)                   behaviour ratio: staleness + training/inference mismatch
    w_it  = min(ρ_it, tis_cap)  (no gradient)        truncated importance sampling (correction: tis)
    ρ̄_i   = exp(mean_t log ρ_it)                     a rollout outside [mask_low, mask_high] is masked whole
    S_it  = min(r_it·A_i, clip(r_it)·A_i),  and for A_i < 0: max(S_it, c·A_i)   dual clip (c = dual_clip)
    L_it  = −w_it · S_it + β·(exp(q) − q − 1),   q = log π_ref − log π_θ

Both log-ratios are clamped to ±20 before exp (as verl does), so a token the policy has all but ruled
out cannot make the loss inf. The dual clip bounds what one token with a negative advantage can
contribute when its ratio is far above 1 (DAPO/verl's clip_ratio_c, 3 by default): without it
−r·A grows with r unbounded, and there is no gradient there once the bound acts.

and the batch loss is Σ_i Σ_t m_it·L_it·s_i with the aggregation's scale s_i:
`token_mean` 1/Σ_i n_i (every token of the batch weighs the same), `sequence_mean` 1/(N·n_i) (every
rollout weighs the same, GRPO's paper), `constant` 1/(N·C) (Dr. GRPO: a fixed normaliser, no length
bias), where n_i = Σ_t m_it, N the rollouts of the batch, C `max_tokens`. A rollout trained as several
segments (its token sequences, `sequence_scales`' `rollouts_of`) has one n_i over all of them; the ρ̄
mask is per sequence (`rollout_index` numbers sequences), so a segment that strayed is masked alone.

The scales are computed once over the whole batch (every micro-batch, every process), so gradient
accumulation and data parallelism sum to exactly the gradient of one pass over the batch.

`objective: surogate` (`surogate_loss`) is the loss of Surogate's GRPO specification (prime-rl's masked
importance sampling), written out in docs/train-objective.md beside the one above.

For every token t of sequence i that the policy sampled, with A_it its advantage (the rollout's, or its
model turn's) and no π_old (the ratio is to the sampling policy μ directly):

    log ρ_it = log π_θ,it − log μ_it      (no gradient; clamped to ±20 before exp)
    ρ̄_i      = exp(mean_t log ρ_it)                                   geometric-mean ratio of sequence i
    R_it     = ρ_it                            ratio_type: token
               min(ρ̄_i, sequence_clip_high)    ratio_type: sequence (one ratio per sequence, GSPO-style)
    c_it     = R_it · (adv_tau · A_it − kl_tau · log ρ_it − teacher_tau · (log π_θ,it − log π_T,it))   (no gradient)
    keep_it  = token_mask_low ≤ ρ_it ≤ token_mask_high
               and geo_mask_low ≤ ρ̄_i ≤ geo_mask_high
               and min_t ρ_it ≥ sequence_mask_low and max_t ρ_it ≤ sequence_mask_high
    L_it     = −c_it · log π_θ,it  (+ kl_beta · k3 to the reference, as under ppo_tis)

and the batch loss is Σ_i Σ_t keep_it · L_it · s_i with the aggregation's s_i (`sequence_scales`).
log π_T is the teacher's logprob of the token (on-policy distillation, `teacher_logprobs`; the loop asks a
teacher model server for them, rollgym.train.loop.teacher): a token the student likes more than the
teacher gets a negative coefficient, one it likes less a positive one, the per-token reverse KL
KL(π_θ ‖ π_T) as a reward (prime-rl's `teacher_tau`, added to the advantage). A token sampled under a
grammar (its teacher logprob NaN: `completion_constrained`) has no teacher term: it was drawn from π_θ
renormalised over what the grammar admitted, so log π_θ − log π_T there is no sample of that KL (it runs
negative wherever the teacher puts more mass than the student on what the grammar admits).
The gradient is −Σ keep · s · c · ∇log π_θ. The value computed is −Σ keep · s · c · (log π_θ − sg(log π_θ)
+ 1), which has that gradient and the value −Σ keep · s · c (the surrogate's, what a history can compare
across steps), rather than −Σ c · log π, whose value mixes in the logprobs' size.
"""

from __future__ import annotations

import math
from typing import Any, Callable, ClassVar, Hashable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .objectives import Aggregation, LossConfig, LossInputs, LossOutputs, Objective

LOG_RATIO_BOUND = 20.0  # |log r| and |log ρ| are clamped to this before exp


class KLToReference(BaseModel):
    """The key both built-in objectives share: a k3 KL term to the reference model."""

    model_config = ConfigDict(extra="forbid")

    kl_beta: float = Field(default=0.0, ge=0.0, description="weight of the k3 KL estimate to the reference model")


class PPOTISConfig(KLToReference):
    """objective: ppo_tis's keys."""

    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0, description="PPO clip below 1")
    clip_high: float = Field(default=0.28, ge=0.0, description="PPO clip above 1 (DAPO's clip-higher)")
    correction: Literal["tis", "none"] = Field(
        default="tis", description="tis: weight each token by min(π_old/μ, tis_cap); none: no behaviour weight")
    tis_cap: float = Field(default=2.0, ge=1.0, description="the truncation of the behaviour ratio")
    mask_low: float | None = Field(default=0.5, gt=0.0, description="mask a rollout whose geometric-mean ρ is below")
    mask_high: float | None = Field(default=2.0, gt=0.0, description="mask a rollout whose geometric-mean ρ is above")
    dual_clip: float | None = Field(
        default=3.0, gt=1.0, description="A < 0: bound a token's term at dual_clip·A (verl's clip_ratio_c); None: off")

    @model_validator(mode="after")
    def _ordered(self) -> "PPOTISConfig":
        if self.mask_low is not None and self.mask_high is not None and self.mask_low >= self.mask_high:
            raise ValueError(f"mask_low {self.mask_low} must be below mask_high {self.mask_high}")
        return self


class SurogateConfig(KLToReference):
    """objective: surogate's keys (its specification's `loss` section, at its defaults)."""

    ratio_type: Literal["token", "sequence"] = Field(
        default="token", description="one ratio per token, or one per sequence (geometric mean)")
    kl_tau: float = Field(default=0.0, ge=0.0, description="weight of the KL term to the sampling policy")
    adv_tau: float = Field(default=1.0, ge=0.0, description="weight of the advantage")
    teacher_tau: float = Field(default=0.0, ge=0.0, description="weight of the teacher's reverse KL")
    token_mask_low: float = Field(default=0.125, ge=0.0, description="mask a token whose ratio is below")
    token_mask_high: float = Field(default=8.0, gt=0.0, description="mask a token whose ratio is above")
    geo_mask_low: float = Field(default=0.1, ge=0.0, description="mask a sequence whose geometric-mean ratio is below")
    geo_mask_high: float = Field(default=10.0, gt=0.0, description="mask a sequence whose geometric-mean ratio is "
                                 "above")
    sequence_mask_low: float = Field(default=0.0, ge=0.0, description="mask a sequence whose smallest token ratio is "
                                     "below")
    sequence_mask_high: float = Field(default=100.0, gt=0.0, description="mask a sequence whose largest token ratio "
                                      "is above")
    sequence_clip_high: float = Field(default=10.0, gt=0.0, description="clip the sequence ratio (ratio_type: "
                                      "sequence)")

    @model_validator(mode="after")
    def _ordered(self) -> "SurogateConfig":
        for low, high in (("token_mask_low", "token_mask_high"), ("geo_mask_low", "geo_mask_high"),
                          ("sequence_mask_low", "sequence_mask_high")):
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(f"{low} {getattr(self, low)} must be below {high} {getattr(self, high)}")
        return self


# The keys of one objective only; `aggregation`, `max_tokens` and `kl_beta` are both objectives'.
PPO_TIS_KEYS = tuple(key for key in PPOTISConfig.model_fields if key not in KLToReference.model_fields)
SUROGATE_KEYS = tuple(key for key in SurogateConfig.model_fields if key not in KLToReference.model_fields)


def sequence_scales(token_counts: Sequence[int], config: LossConfig,
                    rollouts_of: Sequence[Hashable] | None = None) -> list[float]:
    """s_i for every sequence of the whole batch, given its loss tokens. `rollouts_of`: per sequence, the
    rollout it belongs to (a rollout trained as several segments); a rollout's n_i and s_i are over all of
    its segments, and N counts rollouts. Without it every sequence is a rollout."""
    keys = list(rollouts_of) if rollouts_of is not None else list(range(len(token_counts)))
    per_rollout: dict[Hashable, int] = {}
    for key, n in zip(keys, token_counts):
        per_rollout[key] = per_rollout.get(key, 0) + n
    rollouts = len(per_rollout)
    if config.aggregation == "token_mean":
        total = sum(token_counts)
        return [1.0 / total if total else 0.0] * len(keys)
    if config.aggregation == "sequence_mean":
        return [1.0 / (rollouts * per_rollout[k]) if per_rollout[k] else 0.0 for k in keys]
    assert config.max_tokens is not None
    return [1.0 / (rollouts * config.max_tokens)] * len(keys)


# What `LossTerms.stats` holds, in order: sums to be added up over micro-batches, except ρ's min and max.
# The last seven are the surogate objective's masks, each counted on its own (a token or sequence that
# several masks hit counts under each; `masked_tokens` and `masked_rollouts` count the union): tokens for
# the token masks, sequences for the others. They are 0 under ppo_tis.
SUROGATE_STATS = ("token_masked_low", "token_masked_high", "geo_masked_low", "geo_masked_high",
                  "sequence_masked_low", "sequence_masked_high", "sequence_clipped")
STATS = ("rho_sum", "rho_min", "rho_max", "capped", "clipped", "masked_rollouts", "masked_tokens",
         "mismatch_kl_sum", "kl_sum", *SUROGATE_STATS, "teacher_kl_sum", "teacher_tokens")


class LossTerms(LossOutputs):
    """The built-in objectives' outputs: `stats` in the order of STATS, and its values by name: Σ ρ, min ρ,
    max ρ, tokens whose ρ was truncated, tokens whose PPO term was clipped or dual-clipped (no gradient),
    masked rollouts and tokens, Σ (log μ − log π_old) (an estimate of KL(μ ‖ π_old) per token), Σ k3 to the
    reference (0 without one)."""

    def __init__(self, loss: Any, tokens: int, stats: Any) -> None:
        super().__init__(loss=loss, tokens=tokens, stats=stats, names=STATS)

    _stat = LossOutputs.stat
    rho_sum = property(lambda self: self._stat("rho_sum"))
    rho_min = property(lambda self: self._stat("rho_min"))
    rho_max = property(lambda self: self._stat("rho_max"))
    capped = property(lambda self: int(self._stat("capped")))
    clipped = property(lambda self: int(self._stat("clipped")))
    masked_rollouts = property(lambda self: int(self._stat("masked_rollouts")))
    masked_tokens = property(lambda self: int(self._stat("masked_tokens")))
    mismatch_kl_sum = property(lambda self: self._stat("mismatch_kl_sum"))
    kl_sum = property(lambda self: self._stat("kl_sum"))
    teacher_kl_sum = property(lambda self: self._stat("teacher_kl_sum"))
    teacher_tokens = property(lambda self: int(self._stat("teacher_tokens")))


def mask_metrics(sums: dict[str, float], tokens: float, config: LossConfig) -> dict[str, float]:
    """The surogate objective's masks for a step's history (`surogate_mask_metrics`); none under ppo_tis,
    whose one mask is `masked_rollouts`."""
    return surogate_mask_metrics(sums, tokens) if config.objective == "surogate" else {}


def surogate_mask_metrics(sums: dict[str, float], tokens: float) -> dict[str, float]:
    """From a step's summed stats: the fraction of the loss tokens each token mask hit, the sequences each
    sequence mask hit (and the sequence clip)."""
    tokens = max(tokens, 1.0)
    return {"token_mask_low_fraction": sums["token_masked_low"] / tokens,
            "token_mask_high_fraction": sums["token_masked_high"] / tokens,
            "geo_mask_low_rollouts": sums["geo_masked_low"], "geo_mask_high_rollouts": sums["geo_masked_high"],
            "sequence_mask_low_rollouts": sums["sequence_masked_low"],
            "sequence_mask_high_rollouts": sums["sequence_masked_high"],
            "sequence_clipped_rollouts": sums["sequence_clipped"]}


def reference_kl(logprobs: "torch.Tensor", ref_logprobs: "torch.Tensor | None",  # noqa: F821
                 kl_beta: float) -> "torch.Tensor":  # noqa: F821
    """Per token, the k3 estimate of KL(π_θ ‖ π_ref) (exp(q) − q − 1, q = log π_ref − log π_θ); zeros
    without a reference or with kl_beta 0."""
    import torch

    if ref_logprobs is None or kl_beta <= 0:
        return torch.zeros_like(logprobs)
    q = ref_logprobs.detach() - logprobs
    return q.exp() - q - 1.0


def policy_loss(logprobs: "torch.Tensor", old_logprobs: "torch.Tensor", sampling_logprobs: "torch.Tensor",  # noqa: F821
                advantages: "torch.Tensor", rollout_index: "torch.Tensor", scales: "torch.Tensor",  # noqa: F821
                config: LossConfig, ref_logprobs: "torch.Tensor | None" = None,  # noqa: F821
                rollouts: int | None = None, teacher_logprobs: "torch.Tensor | None" = None) -> LossOutputs:  # noqa: F821
    """The configured objective over a micro-batch's loss tokens, as flat 1-D tensors of one length
    (`objectives.LossInputs` says what each is). `rollouts`: how many rollouts the micro-batch has (given,
    nothing here waits for the device)."""
    if rollouts is None:
        rollouts = int(rollout_index.max()) + 1 if int(logprobs.numel()) else 0
    return config.impl(LossInputs(logprobs, old_logprobs, sampling_logprobs, advantages, rollout_index, scales,
                                  rollouts, ref_logprobs, teacher_logprobs))


def ppo_tis_loss(logprobs: "torch.Tensor", old_logprobs: "torch.Tensor",  # noqa: F821
                 sampling_logprobs: "torch.Tensor", advantages: "torch.Tensor",  # noqa: F821
                 rollout_index: "torch.Tensor", scales: "torch.Tensor", config: PPOTISConfig,  # noqa: F821
                 ref_logprobs: "torch.Tensor | None", rollouts: int,  # noqa: F821
                 teacher_logprobs: "torch.Tensor | None" = None) -> LossTerms:  # noqa: F821
    """The ppo_tis objective (the module docstring's first formula) over a micro-batch's loss tokens (a
    teacher's logprobs, if any, take no part in it)."""
    import torch

    count = int(logprobs.numel())
    old = old_logprobs.detach()
    log_rho = (old - sampling_logprobs.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rho = log_rho.exp()
    weight = rho.clamp(max=config.tis_cap) if config.correction == "tis" else torch.ones_like(rho)

    # Every tensor made here is made on the batch's device (on CUDA a CPU one fails at index_add_).
    device = logprobs.device
    per_rollout = torch.zeros(rollouts, dtype=log_rho.dtype, device=device).index_add_(0, rollout_index, log_rho)
    lengths = torch.zeros(rollouts, dtype=log_rho.dtype, device=device).index_add_(
        0, rollout_index, torch.ones_like(log_rho))
    rollout_rho = (per_rollout / lengths.clamp(min=1)).exp()
    keep_rollout = torch.ones(rollouts, dtype=torch.bool, device=device)
    if config.mask_low is not None:
        keep_rollout &= rollout_rho >= config.mask_low
    if config.mask_high is not None:
        keep_rollout &= rollout_rho <= config.mask_high
    keep = keep_rollout[rollout_index].to(logprobs.dtype)

    ratio = (logprobs - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    clipped_ratio = ratio.clamp(1.0 - config.clip_low, 1.0 + config.clip_high)
    unclipped_term, clipped_term = ratio * advantages, clipped_ratio * advantages
    surrogate = torch.minimum(unclipped_term, clipped_term)
    dual = torch.zeros_like(surrogate, dtype=torch.bool)
    if config.dual_clip is not None:
        bound = config.dual_clip * advantages
        dual = (advantages < 0) & (surrogate < bound)
        surrogate = torch.where(dual, bound, surrogate)
    per_token = -weight * surrogate
    kl = reference_kl(logprobs, ref_logprobs, config.kl_beta)
    per_token = per_token + config.kl_beta * kl
    loss = (per_token * keep * scales).sum()
    with torch.no_grad():
        # The clip acts where the clipped term is the smaller one and differs: no gradient flows there.
        # The dual clip acts where A < 0 and r > dual_clip: no gradient there either; both are counted.
        clipped = (((clipped_term < unclipped_term) & (clipped_ratio != ratio)) | dual).sum()
        one = torch.ones((), dtype=rho.dtype, device=device)
        capped = (rho > config.tis_cap).sum() if config.correction == "tis" else 0 * one
        stats = torch.stack([
            rho.sum(), rho.amin() if count else one, rho.amax() if count else one, capped.to(rho.dtype),
            clipped.to(rho.dtype), (~keep_rollout).sum().to(rho.dtype), (keep == 0).sum().to(rho.dtype),
            (-log_rho).sum(), kl.detach().sum().to(rho.dtype), *[0 * one] * len(SUROGATE_STATS), 0 * one,
            0 * one]).double()
    return LossTerms(loss=loss, tokens=count, stats=stats)


def surogate_loss(logprobs: "torch.Tensor", old_logprobs: "torch.Tensor",  # noqa: F821
                  sampling_logprobs: "torch.Tensor", advantages: "torch.Tensor",  # noqa: F821
                  rollout_index: "torch.Tensor", scales: "torch.Tensor", config: SurogateConfig,  # noqa: F821
                  ref_logprobs: "torch.Tensor | None", rollouts: int,  # noqa: F821
                  teacher_logprobs: "torch.Tensor | None" = None) -> LossTerms:  # noqa: F821
    """The objective over a micro-batch's loss tokens (the arguments of `grpo_loss.policy_loss`).
    `old_logprobs` only measures the mismatch KL (Σ log μ − log π_old), as under ppo_tis; `teacher_kl_sum`
    is Σ (log π_θ − log π_T) before this step's update over the `teacher_tokens` with a teacher logprob
    (not NaN; 0 without a teacher)."""
    import torch

    count = int(logprobs.numel())
    device = logprobs.device
    current = logprobs.detach()
    log_ratio = (current - sampling_logprobs.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = log_ratio.exp()

    # Per sequence, on the batch's device: mean log ratio, smallest and largest token ratio.
    def per_sequence(fill: float) -> "torch.Tensor":  # noqa: F821
        return torch.full((rollouts,), fill, dtype=log_ratio.dtype, device=device)

    lengths = per_sequence(0.0).index_add_(0, rollout_index, torch.ones_like(log_ratio))
    mean_log = per_sequence(0.0).index_add_(0, rollout_index, log_ratio) / lengths.clamp(min=1)
    geometric = mean_log.exp()
    lowest = per_sequence(math.inf).scatter_reduce_(0, rollout_index, ratio, "amin")
    highest = per_sequence(-math.inf).scatter_reduce_(0, rollout_index, ratio, "amax")

    token_low, token_high = ratio < config.token_mask_low, ratio > config.token_mask_high
    geo_low, geo_high = geometric < config.geo_mask_low, geometric > config.geo_mask_high
    sequence_low, sequence_high = lowest < config.sequence_mask_low, highest > config.sequence_mask_high
    masked_sequence = geo_low | geo_high | sequence_low | sequence_high
    keep = (~(token_low | token_high | masked_sequence[rollout_index])).to(logprobs.dtype)

    if config.ratio_type == "sequence":
        weight = geometric.clamp(max=config.sequence_clip_high)[rollout_index]
        sequence_clipped = geometric > config.sequence_clip_high
    else:
        weight = ratio
        sequence_clipped = torch.zeros_like(geometric, dtype=torch.bool)
    signal = config.adv_tau * advantages - config.kl_tau * log_ratio
    teacher_gap = torch.zeros_like(current)
    taught = torch.zeros_like(current, dtype=torch.bool)
    if config.teacher_tau > 0 and teacher_logprobs is None:
        raise ValueError("loss.teacher_tau > 0 needs the teacher's logprobs of every loss token (a plan's teacher)")
    if teacher_logprobs is not None:
        # NaN: a token sampled under a grammar, outside the teacher term (see the module docstring).
        taught = ~torch.isnan(teacher_logprobs)
        teacher_gap = torch.where(taught, current - teacher_logprobs.detach(), torch.zeros_like(current))
    if config.teacher_tau > 0:
        signal = signal - config.teacher_tau * teacher_gap
    coeff = weight * signal
    per_token = -coeff * (logprobs - current + 1.0)
    kl = reference_kl(logprobs, ref_logprobs, config.kl_beta)
    per_token = per_token + config.kl_beta * kl
    loss = (per_token * keep * scales).sum()

    with torch.no_grad():
        one = torch.ones((), dtype=ratio.dtype, device=device)
        mismatch = (sampling_logprobs.detach() - old_logprobs.detach()).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        counts = dict(zip(SUROGATE_STATS, (token_low, token_high, geo_low, geo_high, sequence_low, sequence_high,
                                           sequence_clipped)))
        stats = torch.stack([
            ratio.sum(), ratio.amin() if count else one, ratio.amax() if count else one, 0 * one, 0 * one,
            masked_sequence.sum().to(ratio.dtype), (keep == 0).sum().to(ratio.dtype), mismatch.sum(),
            kl.detach().sum().to(ratio.dtype), *[counts[name].sum().to(ratio.dtype) for name in SUROGATE_STATS],
            teacher_gap.sum().to(ratio.dtype), taught.sum().to(ratio.dtype)]).double()
    return LossTerms(loss=loss, tokens=count, stats=stats)


def ratio_metrics(sums: dict[str, float], tokens: float) -> dict[str, float]:
    """The built-ins' history entries from a step's reduced statistics (`tokens` at least 1)."""
    return {"importance_ratio_mean": sums["rho_sum"] / tokens, "importance_ratio_min": sums["rho_min"],
            "importance_ratio_max": sums["rho_max"], "tis_capped_fraction": sums["capped"] / tokens,
            "clip_fraction": sums["clipped"] / tokens, "masked_fraction": sums["masked_tokens"] / tokens,
            "masked_rollouts": sums["masked_rollouts"], "mismatch_kl": sums["mismatch_kl_sum"] / tokens,
            "kl": sums["kl_sum"] / tokens}


class BuiltinObjective(Objective):
    """What the two built-ins share: STATS, a loss function of the micro-batch's tensors, the ρ metrics."""

    statistics: ClassVar[tuple[str, ...]] = STATS
    function: ClassVar[Callable[..., LossTerms]]

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        return type(self).function(inputs.logprobs, inputs.old_logprobs, inputs.sampling_logprobs, inputs.advantages,
                                   inputs.rollout_index, inputs.scales, self.config, inputs.ref_logprobs,
                                   inputs.rollouts, inputs.teacher_logprobs)

    def metrics(self, sums: dict[str, float], tokens: float) -> dict[str, float]:
        return ratio_metrics(sums, tokens)


class PPOTIS(BuiltinObjective):
    """PPO clip with truncated importance sampling against the sampling policy (the default)."""

    name: ClassVar[str] = "ppo_tis"
    Config: ClassVar[type[BaseModel]] = PPOTISConfig
    function = staticmethod(ppo_tis_loss)


class Surogate(BuiltinObjective):
    """Surogate's GRPO loss: masked importance sampling to the sampling policy, an optional teacher term."""

    name: ClassVar[str] = "surogate"
    Config: ClassVar[type[BaseModel]] = SurogateConfig
    function = staticmethod(surogate_loss)

    def metrics(self, sums: dict[str, float], tokens: float) -> dict[str, float]:
        return ratio_metrics(sums, tokens) | surogate_mask_metrics(sums, tokens)


__all__ = ["Aggregation", "LOG_RATIO_BOUND", "BuiltinObjective", "LossConfig", "LossTerms", "PPOTIS", "PPOTISConfig", "PPO_TIS_KEYS",
           "STATS", "SUROGATE_KEYS", "SUROGATE_STATS", "Surogate", "SurogateConfig", "mask_metrics", "policy_loss",
           "ppo_tis_loss", "ratio_metrics", "sequence_scales", "surogate_loss", "surogate_mask_metrics"]
