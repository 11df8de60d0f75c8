"""Rollouts JSONL → trainer formats: SFT chat, DPO pairs, GRPO groups, or a Hugging Face dataset.

    rollgym export --input rollouts.jsonl --output sft.jsonl --format sft --min-reward 1.0
    rollgym export --input rollouts.jsonl --output dpo.jsonl --format dpo --min-diff 0.1
    rollgym export --input rollouts.jsonl --output grpo.jsonl --format grpo
    rollgym export --input rollouts.jsonl --output ds/ --format hf --hf-format sft

The pure functions (`rollout_messages`, `sft_record`, `dpo_pairs`, `grpo_record`, ...) work on one
rollout line (a dict, as `collect-rollouts` writes it) or one group of them; `export_file` streams a
rollouts file through them. Messages are built by `chat_conversion.responses_to_chat_request`, the
same conversion the chat model server applies, so an SFT example is exactly what the model saw plus
what it answered. docs/data-formats.md describes every format field by field.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import orjson

from ..chat_conversion import ConversionError, responses_to_chat_request
from .advantages import grpo_advantages
from .jsonl import Report, iter_jsonl
from .records import output_items
from .routing import agent_ref_name

FORMATS = ("sft", "dpo", "grpo", "hf")
HF_FORMATS = ("sft", "dpo", "grpo")
EPS = 1e-6  # added to the group std in the GRPO advantage
MAX_PROBLEMS = 1000  # skipped-line messages kept in ExportStats.problems (all are reported)
TOLERANCE = 1e-9  # reward comparisons forgive float noise: 0.3 - 0.2 counts as a 0.1 difference



class DataError(Exception):
    """A problem with the command's input, phrased for the user (the CLI exits 2 with it)."""


class RolloutError(ValueError):
    """One rollout line that cannot be exported (the line is skipped and reported)."""


# ---------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------


def iter_rollouts(path: Path, report: Report) -> Iterator[tuple[int, dict[str, Any]]]:
    """Stream a rollouts file: (line number, rollout) for each line shaped like a rollout."""
    if not path.is_file():
        raise DataError(f"--input: no such file: {path}")
    for number, _, _, row in iter_jsonl(path, report):
        problem = rollout_problem(row)
        if problem:
            report(number, problem)
            continue
        yield number, row


def rollout_problem(row: dict[str, Any]) -> str | None:
    """Why a parsed line is not a usable rollout, or None (a cheap structural check, no pydantic)."""
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        return "not a rollout: no 'responses_create_params' object"
    if not isinstance(params.get("input"), (str, list)):
        return "field 'responses_create_params.input': must be a string or a list of items"
    response = row.get("response")
    if not (isinstance(response, dict) and isinstance(response.get("output"), list)) \
            and not isinstance(row.get("output"), list):
        return "not a finished rollout: no 'output' list (nor 'response.output')"
    reward = row.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        return f"field 'reward': must be a number, got {type(reward).__name__}"
    return None


# ---------------------------------------------------------------------------
# One rollout
# ---------------------------------------------------------------------------


def _input_items(params: dict[str, Any]) -> list[Any]:
    raw = params.get("input")
    return [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw or [])


def _convert(params: dict[str, Any], items: list[Any]) -> dict[str, Any]:
    """Chat request body (messages, tools) for `instructions` + `items`, as the model server builds it."""
    body = {"input": items}
    for key in ("instructions", "tools"):
        if params.get(key):
            body[key] = params[key]
    try:
        return responses_to_chat_request(body)
    except ConversionError as exc:
        raise RolloutError(f"cannot convert to chat messages: {exc}") from None


def prompt_messages(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages the model was first given: `instructions` as system, then the input items."""
    params = row["responses_create_params"]
    return _convert(params, _input_items(params))["messages"]


def rollout_messages(row: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(prompt messages, completion messages): the completion is the output items as assistant/tool
    messages (assistant `tool_calls`, `tool` messages with `tool_call_id`, `reasoning_content`)."""
    params = row["responses_create_params"]
    items = _input_items(params)
    prompt = _convert(params, items)["messages"]
    full = _convert(params, items + list(output_items(row)))["messages"]
    if full[: len(prompt)] != prompt:
        # The input ended mid-turn (a function_call without its output) and the output continued it.
        raise RolloutError("the output continues the input's last assistant turn; prompt and completion cannot be split")
    return prompt, full[len(prompt) :]


def chat_tools(row: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The rollout's tools in chat format ({"type": "function", "function": {...}}), or None."""
    params = row["responses_create_params"]
    if not params.get("tools"):
        return None
    return _convert(params, []).get("tools")


def task_type(row: dict[str, Any]) -> str | None:
    """The row's `task_type`, else the name in its `agent_ref`, else None."""
    value = row.get("task_type")
    if value not in (None, ""):
        return str(value)
    return agent_ref_name(row)


def sft_record(row: dict[str, Any]) -> dict[str, Any]:
    """One SFT example: {"messages", "reward", ["tools"], ["task_type"]}."""
    prompt, completion = rollout_messages(row)
    record: dict[str, Any] = {"messages": prompt + completion, "reward": row.get("reward")}
    tools = chat_tools(row)
    if tools:
        record["tools"] = tools
    kind = task_type(row)
    if kind is not None:
        record["task_type"] = kind
    return record


def natural_key(value: Any) -> tuple:
    """Sort key that orders "g-r2" before "g-r10" (digits compare as numbers)."""
    parts = re.split(r"(\d+)", str(value))
    return tuple(int(part) if index % 2 else part for index, part in enumerate(parts))


def group_key(row: dict[str, Any], line: int) -> str:
    """A rollout's group: its group_id; a rollout without one is a group of its own."""
    group = row.get("group_id")
    if group not in (None, ""):
        return str(group)
    return str(row.get("rollout_id") or f"line-{line}")


# ---------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------


@dataclass
class DpoCandidate:
    """What DPO keeps of one rollout while its group is buffered."""

    rollout_id: str
    reward: float
    prompt: list[dict[str, Any]]
    completion: list[dict[str, Any]]
    order: int = 0  # position in the input, the last tie-breaker


def dpo_candidate(row: dict[str, Any], order: int = 0) -> DpoCandidate:
    prompt, completion = rollout_messages(row)
    return DpoCandidate(str(row.get("rollout_id", "")), float(row["reward"]), prompt, completion, order)


def dpo_pairs(group_id: str, candidates: Iterable[DpoCandidate], min_diff: float = 0.1) -> list[dict[str, Any]]:
    """Preference pairs of one group: among rollouts with an identical prompt, best with worst, then
    second best with second worst, ... while the reward difference is ≥ min_diff; each rollout is
    used at most once. Ties in reward are broken by rollout_id (natural order), then input order."""
    by_prompt: dict[bytes, list[DpoCandidate]] = {}
    for candidate in candidates:
        by_prompt.setdefault(orjson.dumps(candidate.prompt, option=orjson.OPT_SORT_KEYS), []).append(candidate)
    pairs = []
    for bucket in by_prompt.values():
        ranked = sorted(bucket, key=lambda c: (-c.reward, natural_key(c.rollout_id), c.order))
        best, worst = 0, len(ranked) - 1
        while best < worst:
            chosen, rejected = ranked[best], ranked[worst]
            difference = chosen.reward - rejected.reward
            if difference + TOLERANCE < min_diff or difference <= 0:
                break  # inner pairs are never further apart than this one
            pairs.append({
                "prompt": chosen.prompt,
                "chosen": chosen.completion,
                "rejected": rejected.completion,
                "quality_difference": difference,
                "group_id": group_id,
                "chosen_rollout_id": chosen.rollout_id,
                "rejected_rollout_id": rejected.rollout_id,
            })
            best, worst = best + 1, worst - 1
    return pairs


@dataclass
class GrpoMember:
    """What GRPO keeps of one rollout while its group is buffered."""

    rollout_id: str
    reward: float
    sequences: list[dict[str, Any]] | None
    prefix_ok: bool | None
    order: int = 0


def grpo_member(row: dict[str, Any], order: int = 0) -> GrpoMember:
    """A rollout's reward and token sequences; a rollout with several sequences (segments: its prefix broke)
    keeps every one, each tagged with its `segment` index."""
    sequences = row.get("sequences")
    if isinstance(sequences, list) and len(sequences) > 1:
        sequences = [{**s, "segment": i} if isinstance(s, dict) else s for i, s in enumerate(sequences)]
    return GrpoMember(str(row.get("rollout_id", "")), float(row["reward"]), sequences, row.get("prefix_ok"), order)


def reward_spread(rewards: Iterable[float]) -> float:
    values = list(rewards)
    return max(values) - min(values) if values else 0.0


def grpo_keeps(rewards: list[float], min_reward_diff: float = 0.0) -> bool:
    """A group is trained on when its rewards differ at all and their spread is ≥ min_reward_diff."""
    spread = reward_spread(rewards)
    return spread > TOLERANCE and spread + TOLERANCE >= min_reward_diff


def grpo_record(group_id: str, prompt: list[dict[str, Any]], members: list[GrpoMember], eps: float = EPS) -> dict[str, Any]:
    """One GRPO group: its prompt and every rollout's reward, advantage and token sequences."""
    members = sorted(members, key=lambda m: (natural_key(m.rollout_id), m.order))
    mean, std, normalized, centered = grpo_advantages([m.reward for m in members], eps)
    return {
        "group_id": group_id,
        "prompt": prompt,
        "rollouts": [
            {"rollout_id": m.rollout_id, "reward": m.reward, "advantage": adv, "advantage_mean_only": cen,
             "sequences": m.sequences, "prefix_ok": m.prefix_ok}
            for m, adv, cen in zip(members, normalized, centered)
        ],
        "reward_mean": mean,
        "reward_std": std,
    }


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


@dataclass
class ExportStats:
    format: str
    read: int = 0  # rollout lines read
    written: int = 0  # records written
    filtered: int = 0  # rollouts left out by --min-reward
    no_reward: int = 0  # rollouts without a reward (failures; never exported) or unverified ones not exported
    unverified: int = 0  # of no_reward: collected with skip_verification (sft exports them without --min-reward)
    skipped: int = 0  # malformed lines and rollouts that cannot be converted
    groups: int = 0
    groups_without_pair: int = 0  # dpo
    groups_dropped: int = 0  # grpo: spread below --min-reward-diff (or none at all)
    missing_sequences: int = 0  # grpo: rollouts exported with sequences null
    mixed_prompt_groups: int = 0  # grpo: groups whose rollouts do not share one prompt
    segments: int = 0  # grpo: token sequences written (every segment of every exported rollout)
    multi_segment_rollouts: int = 0  # grpo: exported rollouts with more than one segment
    problems: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        unit = {"sft": "example", "dpo": "pair", "grpo": "group"}[self.format]
        out = [f"read {self.read} rollouts; wrote {self.written} {unit}{'' if self.written == 1 else 's'}"]
        left = [f"{self.filtered} below --min-reward"] if self.format == "sft" else []
        if self.no_reward:
            left.append(f"{self.no_reward} without a reward"
                        + (f" ({self.unverified} unverified: verification skipped)" if self.unverified else ""))
        left.append(f"{self.skipped} malformed or unconvertible lines skipped")
        out.append("left out: " + ", ".join(left))
        if self.format == "dpo":
            out.append(f"groups: {self.groups}, {self.groups_without_pair} produced no pair")
        if self.format == "grpo":
            out.append(f"groups: {self.groups}, {self.groups_dropped} dropped (reward spread below --min-reward-diff or zero)")
            if self.missing_sequences:
                out.append(f"warning: {self.missing_sequences} rollouts have no token sequences (exported as null)")
            if self.multi_segment_rollouts:
                out.append(f"segments: {self.segments} written, {self.multi_segment_rollouts} rollouts with more "
                           "than one (each tagged with its `segment` index); 0 dropped")
            if self.mixed_prompt_groups:
                out.append(f"warning: {self.mixed_prompt_groups} groups mix different prompts (the first is exported)")
        return out


def records(
    path: Path,
    fmt: str,
    stats: ExportStats,
    *,
    min_reward: float | None = None,
    min_diff: float = 0.1,
    min_reward_diff: float = 0.0,
    report: Report | None = None,
) -> Iterator[dict[str, Any]]:
    """The export records of a rollouts file, streamed (dpo and grpo buffer one small entry per rollout,
    grouped, and yield the groups in natural group_id order once the file is read)."""

    def skip(line: int, message: str) -> None:
        stats.skipped += 1
        text = f"{path}:{line}: skipped: {message}"
        if len(stats.problems) < MAX_PROBLEMS:
            stats.problems.append(text)
        if report is not None:
            report(line, text)

    groups: dict[str, list[Any]] = {}
    prompts: dict[str, list[dict[str, Any]]] = {}
    mixed: set[str] = set()
    for line, row in iter_rollouts(path, skip):
        stats.read += 1
        if row.get("reward") is None:
            unverified = row.get("verification") == "skipped"  # SFT without --min-reward needs no reward
            if not (unverified and fmt == "sft" and min_reward is None):
                stats.no_reward += 1
                stats.unverified += unverified
                continue
        try:
            if fmt == "sft":
                if min_reward is not None and row["reward"] + TOLERANCE < min_reward:
                    stats.filtered += 1
                    continue
                record = sft_record(row)
                stats.written += 1
                yield record
            elif fmt == "dpo":
                groups.setdefault(group_key(row, line), []).append(dpo_candidate(row, line))
            else:
                group = group_key(row, line)
                prompt = prompt_messages(row)
                if group not in prompts:
                    prompts[group] = prompt
                elif prompts[group] != prompt:
                    mixed.add(group)
                groups.setdefault(group, []).append(grpo_member(row, line))
        except RolloutError as exc:
            skip(line, str(exc))
    stats.mixed_prompt_groups = len(mixed)
    for group in sorted(groups, key=natural_key):
        stats.groups += 1
        if fmt == "dpo":
            pairs = dpo_pairs(group, groups[group], min_diff)
            if not pairs:
                stats.groups_without_pair += 1
            stats.written += len(pairs)
            yield from pairs
        else:
            members = groups[group]
            if not grpo_keeps([m.reward for m in members], min_reward_diff):
                stats.groups_dropped += 1
                continue
            stats.missing_sequences += sum(m.sequences is None for m in members)
            stats.segments += sum(len(m.sequences) for m in members if isinstance(m.sequences, list))
            stats.multi_segment_rollouts += sum(isinstance(m.sequences, list) and len(m.sequences) > 1 for m in members)
            stats.written += 1
            yield grpo_record(group, prompts[group], members)


def export_file(
    input_path: Path,
    output: Path,
    fmt: str,
    *,
    hf_format: str = "sft",
    min_reward: float | None = None,
    min_diff: float = 0.1,
    min_reward_diff: float = 0.0,
    report: Report | None = None,
) -> ExportStats:
    """Export a rollouts file; JSONL for sft/dpo/grpo, a `save_to_disk` dataset folder for hf."""
    if fmt not in FORMATS:
        raise DataError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    if not input_path.is_file():
        raise DataError(f"--input: no such file: {input_path}")
    kind = hf_format if fmt == "hf" else fmt
    if kind not in HF_FORMATS:
        raise DataError(f"--hf-format: unknown format {hf_format!r} (choose from {', '.join(HF_FORMATS)})")
    if min_reward is not None and kind != "sft":
        raise DataError("--min-reward applies to the sft format only (dpo pairs by --min-diff, grpo by --min-reward-diff)")
    stats = ExportStats(kind)
    stream = records(input_path, kind, stats, min_reward=min_reward, min_diff=min_diff,
                     min_reward_diff=min_reward_diff, report=report)
    if fmt == "hf":
        import_datasets()  # before reading, so a missing library fails fast
        rows = list(stream)
        if not rows:  # an empty saved dataset cannot be loaded back
            raise DataError(f"no {kind} records to save as a Hugging Face dataset ({'; '.join(stats.lines())}); nothing written")
        save_hf_dataset(rows, output)
        return stats
    output.parent.mkdir(parents=True, exist_ok=True)
    with output.open("wb") as handle:
        for record in stream:
            handle.write(orjson.dumps(record) + b"\n")
    return stats


def import_datasets() -> Any:
    """The optional `datasets` library, or a DataError saying how to install it."""
    try:
        import datasets
    except ImportError:
        raise DataError("this needs the Hugging Face `datasets` library: pip install datasets") from None
    return datasets


def save_hf_dataset(rows: list[dict[str, Any]], output: Path) -> None:
    """`Dataset.from_list(rows).save_to_disk(output)`; reload with `datasets.load_from_disk`."""
    datasets = import_datasets()
    try:
        dataset = datasets.Dataset.from_list(rows)
    except Exception as exc:  # pyarrow cannot unify a column's types across rows
        raise DataError(f"cannot build a Hugging Face dataset from these records: {type(exc).__name__}: {exc}") from None
    dataset.save_to_disk(str(output))


# ---------------------------------------------------------------------------
# The command (its options are declared in rollgym.cli)
# ---------------------------------------------------------------------------


def command(args: Any) -> int:
    stats = export_file(
        Path(args.input), Path(args.output), args.format, hf_format=args.hf_format, min_reward=args.min_reward,
        min_diff=args.min_diff, min_reward_diff=args.min_reward_diff,
        report=lambda line, text: print(f"rollgym: {text}", file=sys.stderr),
    )
    print("\n".join(stats.lines()))
    print(f"{args.format} -> {args.output}")
    return 0


__all__ = [
    "DataError",
    "DpoCandidate",
    "ExportStats",
    "GrpoMember",
    "RolloutError",
    "chat_tools",
    "dpo_candidate",
    "dpo_pairs",
    "export_file",
    "grpo_keeps",
    "grpo_member",
    "grpo_record",
    "iter_rollouts",
    "prompt_messages",
    "records",
    "rollout_messages",
    "save_hf_dataset",
    "sft_record",
    "task_type",
]
