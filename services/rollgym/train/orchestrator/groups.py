"""A group (one task's `rollouts_per_example` rollouts) and what is decided about it once it is back.

A group that failed (a rollout still failing after its retries) or is stale (its oldest sampling version,
that of its oldest token when a generation went on across weight updates, lags the batch by more than
`max_off_policy_steps`) is dropped; the difficulty filter (rollgym.data.
rollout_filters, the one home of filters) drops a group whose rewards are all at `reward_max` (or whose mean
reaches `easy_threshold`) as easy, and all at `reward_min` (or whose mean falls to `hard_threshold`) as hard,
and the degenerate-generation filters flag rollouts. A kept group's rollouts get their advantages (the
one computation in `data.advantages`) and the step bookkeeping the trainer and the metrics read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from ...data.advantages import group_advantages
from ...data.records import completion_length
from ...data.rollout_filters import DifficultyConfig, difficulty_verdict, judge
from .config import OrchestratorConfig
from .sources import SourceTask

DropReason = Literal["failed", "stale", "easy", "hard"]


@dataclass
class Group:
    """One task's `rollouts_per_example` rollouts as they came back."""

    env: str
    task: SourceTask
    group_id: str
    tag: int  # the step it was dispatched for
    dispatch_version: int
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # per rollout: the oldest policy version among its tokens
    token_steps: list[dict[int, int]] = field(default_factory=list)  # per rollout: tokens sampled by each version
    verdict: DropReason | None = None  # the difficulty filter's

    def rewards(self) -> list[float]:
        return [float(r["reward"]) for r in self.rollouts]


@dataclass
class VersionChanged:
    """The event that wakes batch forming when the trainer finished a step (the staleness gate moved)."""

    version: int


def group_verdict(group: Group, difficulty: DifficultyConfig) -> DropReason | None:
    """'easy' or 'hard' for a group the difficulty filter drops (decided once, when it comes back)."""
    return None if group.failures else difficulty_verdict(group.rewards(), difficulty)


def drop_reason(group: Group, step: int, config: OrchestratorConfig) -> DropReason | None:
    """Why a finished group cannot be used in batch `step` (None: it can)."""
    if group.failures or len(group.rollouts) < config.rollouts_per_example:
        return "failed"
    if step - 1 - min(group.sampled) > config.max_off_policy_steps:
        return "stale"
    return group.verdict


def annotate(step: int, groups: list[Group], config: OrchestratorConfig) -> list[dict[str, Any]]:
    """The batch's rollouts, each with its group's advantage and where it stands against the step, and the
    degenerate-generation filters' verdicts: `flagged` (every filter type that flags it) and `filtered` (an
    enforced one: the trainer leaves it out; its group's advantages counted it, as Surogate masks it)."""
    rollouts = []
    for group in groups:
        lengths = [completion_length(r) for r in group.rollouts]
        advantages = group_advantages(group.rewards(), lengths, config.advantage)
        token_steps = group.token_steps or [{} for _ in group.rollouts]
        for rollout, advantage, sampled, tokens in zip(group.rollouts, advantages, group.sampled, token_steps):
            rollout.update(advantage=advantage, step=step, env=group.env, generated_for_step=group.tag,
                           sampled_step=sampled, policy_lag=step - 1 - sampled,
                           token_lags={str(step - 1 - version): count for version, count in sorted(tokens.items())})
            if config.filters:
                flagged, enforced = judge(config.filters, token_sequences(rollout))
                if flagged:
                    rollout["flagged"] = flagged
                if enforced:
                    rollout["filtered"] = enforced
            rollouts.append(rollout)
    return rollouts


def token_sequences(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    """A rollout's token sequences (its segments) that carry a sampling logprob per completion token."""
    return [sequence for sequence in rollout.get("sequences") or []
            if isinstance(sequence.get("completion_logprobs"), list)
            and len(sequence["completion_logprobs"]) == len(sequence.get("completion_ids") or [])]


__all__ = ["DropReason", "Group", "VersionChanged", "annotate", "drop_reason", "group_verdict", "token_sequences"]
