"""Curated group records as the GRPO trainer's loss sees them: `TrainSequence`s, one per token sequence of
each rollout (its `sequences` when it has several segments, else its `sequence`), with the rollout's advantage
(or its turns'), its sampling temperature (checked against the sampling contract: a distribution the trainer
cannot rebuild is refused by name) and a teacher's logprobs when the stage has a teacher; and how a batch is
cut into mini-batches rollout by rollout and into processes' shards by tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...data.advantages import token_advantages
from ...data.records import model_token_mask
from ...sampling_contract import trained_temperature
from .base import TrainingFailed


@dataclass
class TrainSequence:
    """One token sequence as the loss sees it: a rollout, or one segment of a rollout with several
    (`rollout` numbers the rollout it belongs to, so the aggregation weighs rollouts, not segments)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]  # 1: a token the policy sampled (not the environment's, not forced)
    sampling_logprobs: list[float]  # NaN where a grammar restricted the sampling: no behaviour ratio there
    advantage: float
    temperature: float
    rollout: int | None = None  # None: a rollout of its own
    # Per completion token, its model turn's advantage (curate.advantage return_to_go); None: `advantage`.
    token_advantages: list[float] | None = None
    # Per completion token, a teacher's logprob (on-policy distillation: loss.teacher_tau), NaN where a grammar
    # restricted the sampling (no teacher term there); None: no teacher.
    teacher_logprobs: list[float] | None = None

    @property
    def loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def sampling_temperature(member: dict[str, Any], where: str) -> float:
    """The temperature a rollout's logprobs belong to, refusing distributions the trainer cannot rebuild
    (the sampling contract)."""
    return trained_temperature(member.get("sampling") or {}, where, TrainingFailed)


def sequences_of(groups: list[dict[str, Any]], temperature: float | None = None) -> list[list[TrainSequence]]:
    """The groups' rollouts as TrainSequences, group by group: one per segment of each rollout (its
    `sequences` when it has several, else its `sequence`), each with the rollout's advantage and number."""
    out = []
    number = 0
    for group in groups:
        members = []
        for member in group["rollouts"]:
            where = f"rollout {member.get('rollout_id')}"
            sampled_at = sampling_temperature(member, where)
            if temperature is not None and not math.isclose(sampled_at, temperature):
                raise TrainingFailed(f"{where}: sampled at temperature {sampled_at}, but optimize.args.temperature is "
                                     f"{temperature}; the ratio must compare one distribution")
            for sequence in member.get("sequences") or [member["sequence"]]:
                members.append(TrainSequence(list(sequence["prompt_ids"]), list(sequence["completion_ids"]),
                                             model_token_mask(sequence), behaviour_logprobs(sequence),
                                             float(member["advantage"]), sampled_at, number,
                                             turn_token_advantages(sequence, where),
                                             teacher_of(sequence, where)))
            number += 1
        out.append(members)
    return out


def behaviour_logprobs(sequence: dict[str, Any]) -> list[float]:
    """A sequence's sampling logprobs (log μ), NaN at the tokens a grammar restricted (`completion_constrained`).
    There μ is the distribution renormalised over what the grammar admitted, as vLLM and SGLang report it
    (their mask comes before their logprobs), or the model's own, as the embedded model reports it: either
    way it is not what the trainer's unconstrained π_old can be divided by, so the trainer takes π_old
    itself there (ρ = 1: no behaviour correction, the PPO ratio still applies) whatever the engine."""
    values = [float(x) for x in sequence["completion_logprobs"]]
    constrained = sequence.get("completion_constrained") or [0] * len(values)
    return [math.nan if c else x for x, c in zip(values, constrained)]


def turn_token_advantages(sequence: dict[str, Any], where: str) -> list[float] | None:
    """A sequence's per-token advantages from its `turn_advantages` (one per model turn), if it has them."""
    if sequence.get("turn_advantages") is None:
        return None
    try:
        return token_advantages(sequence["completion_mask"], sequence["turn_advantages"])
    except ValueError as exc:
        raise TrainingFailed(f"{where}: {exc}") from None


def teacher_of(sequence: dict[str, Any], where: str) -> list[float] | None:
    """A sequence's `teacher_logprobs` (one per completion token), checked against its length, NaN at the
    tokens a grammar restricted (`completion_constrained`): the student sampled those from its distribution
    renormalised over what the grammar admitted, so its and the teacher's full-vocabulary logprobs there
    measure no KL."""
    values = sequence.get("teacher_logprobs")
    if values is None:
        return None
    if len(values) != len(sequence["completion_ids"]):
        raise TrainingFailed(f"{where}: {len(values)} teacher_logprobs for {len(sequence['completion_ids'])} "
                             "completion tokens")
    constrained = sequence.get("completion_constrained") or [0] * len(values)
    return [math.nan if c else float(x) for x, c in zip(values, constrained)]


def rollout_keys(batch: list[TrainSequence]) -> list[Any]:
    """Per sequence, the rollout it belongs to (a sequence without a number is a rollout of its own)."""
    return [seq.rollout if seq.rollout is not None else ("own", i) for i, seq in enumerate(batch)]


def mini_batch_parts(batch: list[TrainSequence], count: int) -> list[list[int]]:
    """`count` parts of the batch's indices, rollout by rollout in turn: a rollout's segments stay in one
    part, so its n_i counts them all."""
    order: dict[Any, int] = {}
    parts: list[list[int]] = [[] for _ in range(count)]
    for i, key in enumerate(rollout_keys(batch)):
        parts[order.setdefault(key, len(order)) % count].append(i)
    return parts


def token_shards(lengths: list[int], world: int) -> list[list[int]]:
    """Positions 0..len(lengths)-1 split into `world` shards of near-equal token counts, each shard's in
    order: the longest first, each to the shard with the fewest tokens so far (the lower rank on a tie).
    Deterministic, so every process computes the same split of the same batch; by tokens, not by index,
    so no process waits on one that drew the long rollouts."""
    shards: list[list[int]] = [[] for _ in range(world)]
    loads = [0] * world
    for position in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        rank = min(range(world), key=lambda r: (loads[r], len(shards[r]), r))
        shards[rank].append(position)
        loads[rank] += lengths[position]
    return [sorted(shard) for shard in shards]


__all__ = ["TrainSequence", "behaviour_logprobs", "mini_batch_parts", "rollout_keys", "sampling_temperature", "sequences_of",
           "teacher_of", "token_shards", "turn_token_advantages"]
