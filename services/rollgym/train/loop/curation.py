"""Curation: collected rollouts → what a trainer trains on, with every dropped rollout counted by reason.

Filters run in this order (each one optional, from the plan's `curate` section):
stale (model_version is not the one being trained) → failed (no reward) or unverified (collected with
`skip_verification`: reward null; kept only by `to_sft` with no key that reads rewards) → no usable token sequence →
tool errors (`tool_success_only`) → `filters` (degenerate generations, `rollgym.data.rollout_filters`: every
flag counted, an `enforce`d one keeps the rollout out of training) → the curriculum (`rollgym.curriculum`, evaluated at the loop's
epoch, on whole groups) → `min_reward` → `min_reward_spread` per group → `top_k_per_group` →
`dedupe_prompts`.
A rollout an enforced filter flags is dropped there, except for groups: it stays in its group so that the
group's advantages are those of every rollout sampled (as Surogate masks it), and leaves only the trained
rollouts. Then one transform: `to_sft` (one record per segment), `to_preferences` (chosen/rejected pairs of a
group, `export.dpo_pairs`), `to_groups` (GRPO groups with advantages, `export.grpo_record`).

A rollout's `sequences` are its segments: each a prefix-consistent run of its model calls (a new one
begins where a prompt did not extend the tokens before it: a chat template that strips earlier
reasoning, an agent that rewrote its history, a sub-agent's conversation). `curate.segments` says
what trains: `all` (default: every segment, each a sample with the rollout's one advantage), `last`
(the last segment only) or `drop` (a rollout with more than one is dropped as `prefix_broken`).
Every built-in trainer trains on the exact tokens, so a rollout without token sequences or with a
segment that lacks sampling logprobs is dropped and counted; a stage left with none at all fails with
that reason (`CurationError`), never trains on nothing or on text.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...data.curriculum import CurriculumConfig, select_groups
from ...data.advantages import AdvantageConfig, rollout_advantages, with_turn_advantages
from ...data.records import model_token_mask, model_versions, output_items
from ...data.rollout_filters import RolloutFilter, judge
from ...sampling_contract import temperature_of, top_p_of
from ...data.export import (
    TOLERANCE, RolloutError, dpo_candidate, dpo_pairs, grpo_keeps, grpo_member, grpo_record, natural_key,
    prompt_messages, rollout_messages,
)

DataKind = Literal["sft", "preferences", "groups"]
SegmentMode = Literal["all", "last", "drop"]
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
    keep_flat_groups: bool = Field(default=False, description="groups: keep groups without reward spread (advantage "
                                   "0), whose tokens a teacher still teaches (on-policy distillation)")
    curriculum: CurriculumConfig | None = Field(default=None, description="the curriculum, evaluated per epoch")
    min_pair_diff: float = Field(default=0.1, ge=0.0, description="preferences: least reward gap of a pair")
    advantage: AdvantageConfig = Field(default_factory=AdvantageConfig,
                                       description="groups: the advantages the trainer uses as they are")
    segments: SegmentMode = Field(
        default="all", description="a rollout with several token sequences (segments): train all, the last, "
                                   "or drop the rollout (prefix_broken)")
    filters: list[RolloutFilter] = Field(
        default_factory=list, description="degenerate-generation filters, Surogate's filters[]: {type: repetition "
                                          "| gibberish, enforce, ...}; each flag counted in history")


@dataclass
class Curated:
    """The records of one curation and what happened to every rollout."""

    kind: DataKind
    records: list[dict[str, Any]]
    rollouts_in: int
    rollouts_kept: int
    dropped: Counter = field(default_factory=Counter)
    replayed: int = 0  # of rollouts_in, how many came from replayed files
    segments: int = 0  # the token sequences the kept rollouts train on (segments: last leaves out the others)
    segments_left_out: int = 0  # segments of kept rollouts not trained on (segments: last)
    flagged: Counter = field(default_factory=Counter)  # rollouts each filter type flagged, enforced or not
    notes: list[str] = field(default_factory=list)  # what the replayed sources said (scores at another level)

    def summary(self) -> dict[str, Any]:
        return {"kind": self.kind, "records": len(self.records), "rollouts_in": self.rollouts_in,
                "rollouts_kept": self.rollouts_kept, "dropped": {k: v for k, v in sorted(self.dropped.items()) if v},
                "segments": self.segments,
                "segments_per_rollout": round(self.segments / self.rollouts_kept, 3) if self.rollouts_kept else 0.0,
                "segments_left_out": self.segments_left_out,
                "dropped_prefix_broken": self.dropped.get("prefix_broken", 0),
                **({"flagged": dict(sorted(self.flagged.items()))} if self.flagged else {}),
                **({"replayed": self.replayed} if self.replayed else {}),
                **({"notes": list(self.notes)} if self.notes else {})}


def reward_keys(config: CurateConfig) -> list[str]:
    """The `curate` keys set that read rewards, which a rollout collected with skip_verification does not have."""
    return [key for key, used in (("min_reward", config.min_reward is not None),
                                  ("top_k_per_group", config.top_k_per_group is not None),
                                  ("min_reward_spread", config.min_reward_spread > 0),
                                  ("curriculum", config.curriculum is not None)) if used]


def unverified_problem(kind: DataKind, config: CurateConfig) -> str | None:
    """Why rollouts collected with skip_verification cannot train under `kind` and `config`, or None."""
    if kind != "sft":
        return (f"unverified rollouts (reward null) cannot make {'GRPO groups' if kind == 'groups' else kind}, "
                "which are ranked or weighed by reward; train on them with data: sft, or verify")
    if keys := reward_keys(config):
        return f"curate.{', curate.'.join(keys)} read rewards, which unverified rollouts (reward null) do not have"
    return None


def on_policy(rollout: dict[str, Any], version: str) -> bool:
    """Every turn of the rollout was generated by `version`: exactly, when it names one set of an
    adapter's weights (`name@DIGEST`); an adapter's bare name matches any weights loaded under it."""
    versions = model_versions(rollout)
    if "@" in version:
        return versions == {version}
    return bool(versions) and all(v == version or v.rsplit("@", 1)[0] == version for v in versions)


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


def usable_sequences(rollout: dict[str, Any], segments: SegmentMode = "all") -> tuple[list[dict[str, Any]], str | None]:
    """(the segments to train on, in order, None) or ([], the reason there are none). `drop`: only a
    rollout with one prefix-consistent sequence (`usable_sequence`); `last`: its last segment; `all`:
    every segment, each needing token ids and a sampling logprob per token."""
    if segments == "drop":
        sequence, problem = usable_sequence(rollout)
        return ([sequence] if sequence is not None else []), problem
    sequences = rollout.get("sequences")
    if not sequences:
        return [], "no_token_ids"
    chosen = list(sequences[-1:] if segments == "last" else sequences)
    for sequence in chosen:
        if not sequence.get("completion_ids"):
            return [], "no_token_ids"
        logprobs = sequence.get("completion_logprobs")
        if not logprobs or len(logprobs) != len(sequence["completion_ids"]) or any(x is None for x in logprobs):
            return [], "no_logprobs"
    return chosen, None


def with_segment(sequence: dict[str, Any], index: int) -> dict[str, Any]:
    """The sequence tagged with its `segment` index (its place in the rollout's `sequences`)."""
    return {**sequence, "segment": index}


def tool_failed(rollout: dict[str, Any]) -> bool:
    for item in output_items(rollout):
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
           version: str | None = None, group_size: int | None = None, stage: str = "stage",
           keep_advantages: bool = False) -> Curated:
    """Filter `rollouts` and turn what is left into `kind` records.

    `version`: the model version being trained; rollouts of any other are stale. `group_size`: for
    groups, the collect repeats (an incomplete group is dropped: GRPO needs equal group sizes).
    `keep_advantages`: the rollouts carry the `advantage` their batch computed (the orchestrator's),
    which the groups keep instead of computing their own.
    """
    dropped: Counter = Counter()
    flagged: Counter = Counter()
    kept: list[dict[str, Any]] = []
    tokens_missing = 0
    for rollout in rollouts:
        if version is not None and not on_policy(rollout, version):
            dropped["stale"] += 1
            continue
        if rollout.get("reward") is None:
            # Verification skipped: no reward to rank, pair or weigh by; plain SFT keeps the rollout.
            unverified = rollout.get("verification") == "skipped"
            if not unverified or kind != "sft" or reward_keys(config):
                dropped["unverified" if unverified else "failed"] += 1
                continue
        chosen, problem = usable_sequences(rollout, config.segments)
        if problem:
            dropped[problem] += 1
            tokens_missing += 1
            continue
        if config.tool_success_only and tool_failed(rollout):
            dropped["tool_error"] += 1
            continue
        first = len(rollout["sequences"]) - len(chosen)  # the segment index of chosen[0]
        segments = ([with_segment(s, first + i) for i, s in enumerate(chosen)] if len(rollout["sequences"]) > 1
                    else chosen)
        types, enforced = judge(config.filters, segments)
        if not config.filters:  # mode: async: the orchestrator applied its own (rollgym.data.rollout_filters)
            types, enforced = rollout.get("flagged") or [], rollout.get("filtered")
        flagged.update(types)
        if enforced is not None and kind != "groups":
            dropped[enforced] += 1
            continue
        kept.append({**rollout, "_sequence": segments[0], "_segments": segments, "_filtered": enforced})
    if rollouts and not kept and config.segments == "drop" and dropped.get("prefix_broken") == len(rollouts):
        raise CurationError(
            f"{stage}: every one of the {len(rollouts)} rollouts has several segments (a template that strips "
            "earlier reasoning, a rewritten history, a sub-agent) and curate.segments is drop: use all or last")
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
        if not groups[g]:
            del groups[g]
            continue
        rewards = [float(r["reward"]) for r in groups[g] if r["reward"] is not None]  # SFT keeps unverified ones
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

    if kind == "groups":
        records, used = _to_groups(groups, dropped, group_size, config, keep_advantages)
    else:
        builder = {"sft": _to_sft, "preferences": _to_preferences}[kind]
        records, used = builder(groups, dropped, group_size, config)
    return Curated(kind, records, len(rollouts), len(used), dropped,
                   segments=sum(len(r["_segments"]) for r in used),
                   segments_left_out=sum(len(r["sequences"]) - len(r["_segments"]) for r in used), flagged=flagged)


def _to_sft(groups: dict[str, list[dict[str, Any]]], dropped: Counter, group_size: int | None,
            config: CurateConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    used = [r for g in sorted(groups, key=natural_key) for r in groups[g]]
    return [record for r in used for record in to_sft_segments(r)], used


def to_sft(rollout: dict[str, Any]) -> dict[str, Any]:
    """One SFT record: the exact token sequence (loss on completion_mask = 1) and the chat messages."""
    sequence = rollout.get("_sequence") or usable_sequence(rollout)[0]
    if sequence is None:
        raise RolloutError(f"rollout {rollout.get('rollout_id')} has no usable token sequence")
    prompt, completion = rollout_messages(rollout)
    record = {"rollout_id": rollout.get("rollout_id"), "group_id": rollout.get("group_id"),
              "reward": rollout.get("reward"), "messages": prompt + completion,
              "prompt_ids": sequence["prompt_ids"], "completion_ids": sequence["completion_ids"],
              "completion_mask": sequence["completion_mask"]}
    if "segment" in sequence:
        record["segment"] = sequence["segment"]
    return record


def to_sft_segments(rollout: dict[str, Any]) -> list[dict[str, Any]]:
    """One SFT record per segment the rollout trains on (`to_sft`), each with its `segment` index when the
    rollout has more than one; all carry the rollout's messages."""
    return [to_sft({**rollout, "_sequence": segment}) for segment in rollout.get("_segments") or [None]]


def _to_preferences(groups: dict[str, list[dict[str, Any]]], dropped: Counter, group_size: int | None,
                    config: CurateConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records: list[dict[str, Any]] = []
    for g in sorted(groups, key=natural_key):
        records.extend(to_preferences(g, groups[g], config.min_pair_diff))
    paired = {r[key] for r in records for key in ("chosen_rollout_id", "rejected_rollout_id")}
    used = [r for g in sorted(groups, key=natural_key) for r in groups[g] if str(r.get("rollout_id")) in paired]
    dropped["unpaired"] += sum(len(m) for m in groups.values()) - len(used)
    return records, [{**r, "_segments": r["_segments"][:1]} for r in used]


def to_preferences(group_id: str, members: list[dict[str, Any]], min_diff: float = 0.1) -> list[dict[str, Any]]:
    """Chosen/rejected pairs of one group (`export.dpo_pairs`) with their exact token ids. A rollout with
    several segments is compared by its first: the one continuation of the group's shared prompt (a later
    segment's prompt holds that rollout's own history, so two of them are no one comparison)."""
    by_id = {str(r.get("rollout_id")): r for r in members}
    pairs = []
    for pair in dpo_pairs(group_id, [dpo_candidate(r, i) for i, r in enumerate(members)], min_diff):
        chosen = by_id[pair["chosen_rollout_id"]]["_sequence"]
        rejected = by_id[pair["rejected_rollout_id"]]["_sequence"]
        if chosen["prompt_ids"] != rejected["prompt_ids"]:
            continue  # the same prompt text rendered to other tokens: not one comparison
        pairs.append({**pair, "prompt_ids": chosen["prompt_ids"], "chosen_ids": chosen["completion_ids"],
                      "rejected_ids": rejected["completion_ids"], "chosen_mask": model_token_mask(chosen),
                      "rejected_mask": model_token_mask(rejected)})
    return pairs


def _to_groups(groups: dict[str, list[dict[str, Any]]], dropped: Counter, group_size: int | None,
               config: CurateConfig, keep_advantages: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    records: list[dict[str, Any]] = []
    used: list[dict[str, Any]] = []
    for g in sorted(groups, key=natural_key):
        members = groups[g]
        if group_size is not None and len(members) != group_size:
            dropped["incomplete_group"] += len(members)
            continue
        if not grpo_keeps([float(r["reward"]) for r in members]) and not config.keep_flat_groups:
            dropped["zero_reward_spread"] += len(members)
            continue
        record = to_groups(g, members, config.advantage, keep_advantages)
        masked = {str(r.get("rollout_id")): r["_filtered"] for r in members if r.get("_filtered")}
        if masked:  # the group's advantages counted them; they are not trained on
            dropped.update(masked.values())
            record["rollouts"] = [m for m in record["rollouts"] if m["rollout_id"] not in masked]
        if record["rollouts"]:
            records.append(record)
        used.extend(r for r in members if not r.get("_filtered"))
    return records, used


def to_groups(group_id: str, members: list[dict[str, Any]], advantage: AdvantageConfig | None = None,
              keep_advantages: bool = False) -> dict[str, Any]:
    """One GRPO group (`export.grpo_record`: rewards), each rollout with its `sequence`, the `sampling`
    it was generated under and its `advantage`: the one it carries (`keep_advantages`), else the
    group's under `advantage` (default: GRPO's normalised). The trainer uses it as it is. A rollout that
    trains on several segments also has `sequences`: each of them with its `segment` index (`sequence`
    is then the last of them, for a reader of one sequence); the trainer trains every one."""
    record = grpo_record(group_id, prompt_messages(members[0]), [grpo_member(r, i) for i, r in enumerate(members)])
    by_id = {str(r.get("rollout_id", "")): r for r in members}
    ordered = [by_id[m["rollout_id"]] for m in record["rollouts"]]
    turns: list[Any] | None = None  # return_to_go: per rollout, its model turns' advantages
    if keep_advantages and all(r.get("advantage") is not None for r in ordered):
        values = [float(r["advantage"]) for r in ordered]
    else:
        values, turns = rollout_advantages(ordered, advantage or AdvantageConfig())
    for rollout, source, value, turn_values in zip(record["rollouts"], ordered, values, turns or [None] * len(ordered)):
        sequences = rollout.pop("sequences")
        segments = with_turn_advantages(source, source.get("_segments") or (
            [with_segment(x, i) for i, x in enumerate(sequences)] if len(sequences) > 1 else sequences), turn_values)
        rollout["sequence"] = segments[-1]
        if len(segments) > 1:
            rollout["sequences"] = segments
        rollout["advantage"] = value
        rollout["sampling"] = sampling_of(source)
    return record


def sampling_of(rollout: dict[str, Any]) -> dict[str, Any]:
    """What a rollout's tokens were sampled under: the model server's record on its generated items,
    else the request's parameters, with the logprobs' kind unknown."""
    for item in output_items(rollout):
        if isinstance(item, dict) and isinstance(item.get("sampling"), dict):
            return dict(item["sampling"])
    params = rollout.get("responses_create_params") or {}
    return {"temperature": temperature_of(params), "top_p": top_p_of(params), "logprobs": "unknown"}


__all__ = ["CurateConfig", "Curated", "CurationError", "curate", "on_policy", "reward_keys", "sampling_of", "to_groups",
           "to_preferences", "to_sft", "to_sft_segments", "tool_failed", "unverified_problem", "usable_sequence",
           "usable_sequences"]
