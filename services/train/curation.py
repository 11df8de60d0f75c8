"""Curation: collected rollouts → what a trainer trains on, with every dropped rollout counted by reason.

Filters run in this order (each one optional, from the plan's `curate` section):
stale (model_version is not the one being trained) → failed (no reward) → no usable token sequence →
tool errors (`tool_success_only`) → `min_reward` → the curriculum (`rollgym.curriculum`, evaluated
at the loop's epoch) → `min_reward_spread` per group → `top_k_per_group` → `dedupe_prompts`.
Then one transform: `to_sft` (one record per rollout), `to_preferences` (chosen/rejected pairs of a
group, `export.dpo_pairs`), `to_groups` (GRPO groups with advantages, `export.grpo_record`).

Every built-in trainer trains on the exact tokens, so a rollout without one clean token sequence
(`sequences` missing, no sampling logprobs, or `prefix_ok: false`) is dropped and counted; a stage
left with none at all fails with that reason (`CurationError`), never trains on nothing or on text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..data.curriculum import CurriculumConfig, select_groups
from ..data.export import (
    TOLERANCE, RolloutError, dpo_candidate, dpo_pairs, grpo_keeps, grpo_member, grpo_record, natural_key,
    prompt_messages, rollout_messages,
)

DataKind = Literal["sft", "preferences", "groups"]
TOOL_ERROR_PREFIX = "Error:"  # how the agent phrases a tool call it could not make (agents/simple_agent)


class CurationError(ValueError):
    """Curation left nothing to train on; the message says why."""


class CurateConfig(BaseModel):
    """The plan's `curate` section."""

    model_config = ConfigDict(extra="forbid")

    min_reward: float | None = Field(default=None, description="drop rollouts whose reward is below this")
    tool_success_only: bool = Field(default=False, description="drop rollouts with a tool call that returned an error")
    top_k_per_group: int | None = Field(default=None, ge=1, description="keep the k best rollouts of each group")
    dedupe_prompts: bool = Field(default=False, description="keep one group per identical prompt")
    min_reward_spread: float = Field(default=0.0, ge=0.0, description="drop groups whose max-min reward is below this")
    curriculum: CurriculumConfig | None = Field(default=None, description="the curriculum, evaluated per epoch")
    min_pair_diff: float = Field(default=0.1, ge=0.0, description="preferences: least reward gap of a pair")


@dataclass
class Curated:
    """The records of one curation and what happened to every rollout."""

    kind: DataKind
    records: list[dict[str, Any]]
    rollouts_in: int
    rollouts_kept: int
    dropped: Counter = field(default_factory=Counter)

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "records": len(self.records), "rollouts_in": self.rollouts_in,
                "rollouts_kept": self.rollouts_kept, "dropped": {k: v for k, v in sorted(self.dropped.items()) if v}}


def model_version(rollout: dict[str, Any]) -> str | None:
    """The model version that generated a rollout: its response's `model_version`, else the last
    generated item's, else the response's `model` (the served model's name)."""
    response = rollout.get("response") or {}
    if response.get("model_version"):
        return str(response["model_version"])
    for item in reversed(response.get("output") or []):
        if isinstance(item, dict) and item.get("model_version"):
            return str(item["model_version"])
    model = response.get("model")
    return str(model) if model else None


def usable_sequence(rollout: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(the rollout's one token sequence, None) or (None, the reason it has none)."""
    sequences = rollout.get("sequences")
    if not sequences:
        return None, "no_token_ids"
    if len(sequences) > 1 or rollout.get("prefix_ok") is False:
        return None, "prefix_broken"
    sequence = sequences[0]
    if not sequence.get("completion_ids"):
        return None, "no_token_ids"
    logprobs = sequence.get("completion_logprobs")
    if not logprobs or len(logprobs) != len(sequence["completion_ids"]) or any(x is None for x in logprobs):
        return None, "no_logprobs"
    return sequence, None


def tool_failed(rollout: dict[str, Any]) -> bool:
    for item in (rollout.get("response") or {}).get("output") or []:
        if isinstance(item, dict) and item.get("type") == "function_call_output":
            if str(item.get("output", "")).startswith(TOOL_ERROR_PREFIX):
                return True
    return False


def _group(rollout: dict[str, Any]) -> str:
    return str(rollout.get("group_id") or rollout.get("rollout_id"))


def _by_group(rollouts: Iterable[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for rollout in rollouts:
        groups.setdefault(_group(rollout), []).append(rollout)
    return groups


def curate(rollouts: list[dict[str, Any]], kind: DataKind, config: CurateConfig, *, epoch: int = 0,
           version: str | None = None, group_size: int | None = None, stage: str = "stage") -> Curated:
    """Filter `rollouts` and turn what is left into `kind` records.

    `version`: the model version being trained; rollouts of any other are stale. `group_size`: for
    groups, the collect repeats (an incomplete group is dropped: GRPO needs equal group sizes).
    """
    dropped: Counter = Counter()
    kept: list[dict[str, Any]] = []
    tokens_missing = 0
    for rollout in rollouts:
        if version is not None and model_version(rollout) != version:
            dropped["stale"] += 1
            continue
        if rollout.get("reward") is None:
            dropped["failed"] += 1
            continue
        sequence, problem = usable_sequence(rollout)
        if problem:
            dropped[problem] += 1
            tokens_missing += 1
            continue
        if config.tool_success_only and tool_failed(rollout):
            dropped["tool_error"] += 1
            continue
        kept.append({**rollout, "_sequence": sequence})
    if rollouts and not kept and tokens_missing:
        raise CurationError(
            f"{stage}: none of the {len(rollouts)} rollouts carries token ids and sampling logprobs "
            f"({', '.join(f'{k}: {v}' for k, v in sorted(dropped.items()))}); the model server must return them "
            "(the embedded model does; chat_completions needs return_token_ids: true and logprobs)")

    groups = _by_group(kept)
    if config.curriculum is not None:
        chosen = set(select_groups({g: [float(r["reward"]) for r in rs] for g, rs in groups.items()},
                                   config.curriculum, epoch))
        for g in list(groups):
            if g not in chosen:
                dropped["curriculum"] += len(groups.pop(g))
    if config.min_reward is not None:
        for g, members in groups.items():
            low = [r for r in members if float(r["reward"]) + TOLERANCE < config.min_reward]
            dropped["below_min_reward"] += len(low)
            groups[g] = [r for r in members if r not in low]
    for g in list(groups):
        rewards = [float(r["reward"]) for r in groups[g]]
        if not rewards:
            del groups[g]
            continue
        if config.min_reward_spread > 0 and max(rewards) - min(rewards) + TOLERANCE < config.min_reward_spread:
            dropped["low_reward_spread"] += len(groups.pop(g))
    if config.top_k_per_group is not None:
        for g, members in groups.items():
            ranked = sorted(members, key=lambda r: (-float(r["reward"]), natural_key(r.get("rollout_id"))))
            dropped["not_top_k"] += len(ranked[config.top_k_per_group:])
            groups[g] = ranked[: config.top_k_per_group]
    if config.dedupe_prompts:
        seen: set[str] = set()
        for g in sorted(groups, key=natural_key):
            key = repr(groups[g][0]["_sequence"]["prompt_ids"])
            if key in seen:
                dropped["duplicate_prompt"] += len(groups.pop(g))
            else:
                seen.add(key)

    builder = {"sft": _to_sft, "preferences": _to_preferences, "groups": _to_groups}[kind]
    records, used = builder(groups, dropped, group_size, config)
    return Curated(kind, records, len(rollouts), used, dropped)


def _to_sft(groups: dict[str, list[dict[str, Any]]], dropped: Counter, group_size: int | None,
            config: CurateConfig) -> tuple[list[dict[str, Any]], int]:
    records = [to_sft(r) for g in sorted(groups, key=natural_key) for r in groups[g]]
    return records, len(records)


def to_sft(rollout: dict[str, Any]) -> dict[str, Any]:
    """One SFT record: the exact token sequence (loss on completion_mask = 1) and the chat messages."""
    sequence = rollout.get("_sequence") or usable_sequence(rollout)[0]
    if sequence is None:
        raise RolloutError(f"rollout {rollout.get('rollout_id')} has no usable token sequence")
    prompt, completion = rollout_messages(rollout)
    return {"rollout_id": rollout.get("rollout_id"), "group_id": rollout.get("group_id"),
            "reward": rollout.get("reward"), "messages": prompt + completion,
            "prompt_ids": sequence["prompt_ids"], "completion_ids": sequence["completion_ids"],
            "completion_mask": sequence["completion_mask"]}


def _to_preferences(groups: dict[str, list[dict[str, Any]]], dropped: Counter, group_size: int | None,
                    config: CurateConfig) -> tuple[list[dict[str, Any]], int]:
    records: list[dict[str, Any]] = []
    for g in sorted(groups, key=natural_key):
        records.extend(to_preferences(g, groups[g], config.min_pair_diff))
    used = 2 * len(records)
    dropped["unpaired"] += sum(len(m) for m in groups.values()) - used
    return records, used


def to_preferences(group_id: str, members: list[dict[str, Any]], min_diff: float = 0.1) -> list[dict[str, Any]]:
    """Chosen/rejected pairs of one group (`export.dpo_pairs`) with their exact token ids."""
    by_id = {str(r.get("rollout_id")): r for r in members}
    pairs = []
    for pair in dpo_pairs(group_id, [dpo_candidate(r, i) for i, r in enumerate(members)], min_diff):
        chosen = by_id[pair["chosen_rollout_id"]]["_sequence"]
        rejected = by_id[pair["rejected_rollout_id"]]["_sequence"]
        if chosen["prompt_ids"] != rejected["prompt_ids"]:
            continue  # the same prompt text rendered to other tokens: not one comparison
        pairs.append({**pair, "prompt_ids": chosen["prompt_ids"], "chosen_ids": chosen["completion_ids"],
                      "rejected_ids": rejected["completion_ids"]})
    return pairs


def _to_groups(groups: dict[str, list[dict[str, Any]]], dropped: Counter, group_size: int | None,
               config: CurateConfig) -> tuple[list[dict[str, Any]], int]:
    records = []
    for g in sorted(groups, key=natural_key):
        members = groups[g]
        if group_size is not None and len(members) != group_size:
            dropped["incomplete_group"] += len(members)
            continue
        if not grpo_keeps([float(r["reward"]) for r in members]):
            dropped["zero_reward_spread"] += len(members)
            continue
        records.append(to_groups(g, members))
    return records, sum(len(r["rollouts"]) for r in records)


def to_groups(group_id: str, members: list[dict[str, Any]]) -> dict[str, Any]:
    """One GRPO group (`export.grpo_record`: rewards, advantages), each rollout with its `sequence`."""
    record = grpo_record(group_id, prompt_messages(members[0]), [grpo_member(r, i) for i, r in enumerate(members)])
    for rollout in record["rollouts"]:
        rollout["sequence"] = rollout.pop("sequences")[0]
    return record


__all__ = ["CurateConfig", "Curated", "CurationError", "curate", "model_version", "to_groups", "to_preferences",
           "to_sft", "tool_failed", "usable_sequence"]
