"""Curriculum selection of rollout groups, as in the NeMo Agent Toolkit finetuning harness.

A group (one task's rollouts) is as easy as its mean reward is high. At epoch `e` the curriculum
keeps the groups whose reward spread (max − min) is at least `min_reward_diff`, sorts them by mean
reward (easiest first for `easy_to_hard`, hardest first for `hard_to_easy`) and takes the first
ceil(p·n) of the n left, where

    p = min(1, initial_percentile + increment_percentile · (e // expansion_interval))

then, if `random_subsample` is set, a seeded random fraction of those (kept in curriculum order).

    config = CurriculumConfig(initial_percentile=0.3, increment_percentile=0.2, expansion_interval=5)
    chosen = select_groups({"g1": [1.0, 0.0], "g2": [0.5, 0.25]}, config, epoch=0)

Also here: `filter_by_difficulty` (online difficulty filtering: drop groups every rollout solved or
every rollout failed) and `mix` (sample rows from several environments at given ratios).
The CLI, `rollgym curriculum`, writes the rollouts of the selected groups of a rollouts file.
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .export import TOLERANCE, DataError, group_key, natural_key, rollout_problem
from .jsonl import iter_jsonl

T = TypeVar("T")


class CurriculumConfig(BaseModel):
    """The curriculum's parameters (NeMo Agent Toolkit's `curriculum_learning` section, where
    `sort_ascending: false` is `sort="easy_to_hard"`), with its defaults: a group needs a reward
    spread of 0.1 to teach anything, and the admitted share grows every 5 epochs.

    A NAT section pastes in as it is: `sort_ascending` is read as `sort` (true: hard_to_easy), and
    `enabled: false` as a curriculum that keeps every group (all of them at every epoch, no spread
    needed, no subsample); `enabled: true` is what the section's presence means already."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nat_names(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not {"sort_ascending", "enabled"} & set(data):
            return data
        data = dict(data)
        if "sort_ascending" in data:
            ascending = data.pop("sort_ascending")
            if "sort" in data:
                raise ValueError("give sort or sort_ascending (NAT's name for it), not both")
            if not isinstance(ascending, bool):
                raise ValueError(f"sort_ascending: true (hard to easy) or false (easy to hard), not {ascending!r}")
            data["sort"] = "hard_to_easy" if ascending else "easy_to_hard"
        enabled = data.pop("enabled", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"enabled: true or false, not {enabled!r}")
        if not enabled:
            data.update(initial_percentile=1.0, increment_percentile=0.0, min_reward_diff=0.0, random_subsample=None)
        return data

    sort: Literal["easy_to_hard", "hard_to_easy"] = "easy_to_hard"
    min_reward_diff: float = Field(default=0.1, ge=0.0, description="least max-min reward of a kept group")
    initial_percentile: float = Field(default=0.3, gt=0.0, le=1.0, description="fraction of groups at epoch 0")
    increment_percentile: float = Field(default=0.2, ge=0.0, le=1.0, description="fraction added per expansion")
    expansion_interval: int = Field(default=5, ge=1, description="epochs between expansions")
    random_subsample: float | None = Field(default=None, gt=0.0, le=1.0, description="keep this random fraction")
    seed: int = 0

    def percentile(self, epoch: int) -> float:
        """The fraction of groups the curriculum admits at `epoch` (0-based)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        return min(1.0, self.initial_percentile + self.increment_percentile * (epoch // self.expansion_interval))


@dataclass(frozen=True)
class Stage:
    """One step of a selection: what was left after it."""

    name: str
    groups: int
    rollouts: int
    mean_reward: float | None  # over the rollouts of the groups left


def _stage(name: str, groups: Mapping[str, Sequence[float]], ids: Sequence[str]) -> Stage:
    rewards = [r for group in ids for r in groups[group]]
    return Stage(name, len(ids), len(rewards), math.fsum(rewards) / len(rewards) if rewards else None)


def _count(fraction: float, n: int) -> int:
    """ceil(fraction · n), forgiving float noise (0.3 · 10 is 3, not 4)."""
    return min(n, math.ceil(fraction * n - TOLERANCE))


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def select_groups_staged(
    groups: Mapping[str, Sequence[float]], config: CurriculumConfig, epoch: int
) -> tuple[list[str], list[Stage]]:
    """`select_groups`, with what each stage (input, spread filter, percentile, subsample) left."""
    percentile = config.percentile(epoch)
    present = [group for group, rewards in groups.items() if len(rewards)]
    stages = [_stage("input", groups, present)]
    spread = [g for g in present if max(groups[g]) - min(groups[g]) + TOLERANCE >= config.min_reward_diff]
    stages.append(_stage(f"reward spread >= {config.min_reward_diff:g}", groups, spread))
    sign = -1.0 if config.sort == "easy_to_hard" else 1.0
    ordered = sorted(spread, key=lambda g: (sign * _mean(groups[g]), natural_key(g)))
    chosen = ordered[: _count(percentile, len(ordered))]
    label = "easiest" if config.sort == "easy_to_hard" else "hardest"
    stages.append(_stage(f"{label} {percentile:.0%} (epoch {epoch})", groups, chosen))
    if config.random_subsample is not None:
        rng = random.Random(f"{config.seed}:{epoch}")
        keep = set(rng.sample(chosen, _count(config.random_subsample, len(chosen))))
        chosen = [g for g in chosen if g in keep]
        stages.append(_stage(f"random {config.random_subsample:.0%} (seed {config.seed})", groups, chosen))
    return chosen, stages


def select_groups(groups: Mapping[str, Sequence[float]], config: CurriculumConfig, epoch: int) -> list[str]:
    """The group ids the curriculum trains on at `epoch` (0-based), in curriculum order.

    `groups` maps group_id → the rewards of its rollouts. Ties in mean reward are broken by
    group_id (natural order). The random subsample is seeded by (config.seed, epoch): reruns agree
    and every epoch draws afresh.
    """
    return select_groups_staged(groups, config, epoch)[0]


def filter_by_difficulty(
    groups: Mapping[str, Sequence[float]], drop_all_zero: bool = True, drop_all_one: bool = True
) -> dict[str, list[float]]:
    """Online difficulty filtering: drop groups that every rollout failed (all rewards ≤ 0) and/or
    every rollout solved (all rewards ≥ 1); such groups carry no GRPO signal."""
    kept: dict[str, list[float]] = {}
    for group, rewards in groups.items():
        rewards = list(rewards)
        if not rewards:
            continue
        if drop_all_zero and all(r <= 0.0 for r in rewards):
            continue
        if drop_all_one and all(r >= 1.0 for r in rewards):
            continue
        kept[group] = rewards
    return kept


def allocate(ratios: Mapping[str, float], total: int) -> dict[str, int]:
    """Split `total` by `ratios` (normalized) with the largest-remainder method; ties go to the
    environment named first in sorted order. Counts add up to `total` exactly."""
    if total < 0:
        raise ValueError(f"total must be >= 0, got {total}")
    for env, ratio in ratios.items():
        if ratio < 0 or not math.isfinite(ratio):
            raise ValueError(f"ratio of {env!r} must be a finite number >= 0, got {ratio}")
    weight = math.fsum(ratios.values())
    if weight <= 0:
        raise ValueError("at least one ratio must be > 0")
    exact = {env: total * ratio / weight for env, ratio in sorted(ratios.items())}
    counts = {env: math.floor(value + TOLERANCE) for env, value in exact.items()}
    left = total - sum(counts.values())
    by_remainder = sorted(exact, key=lambda env: (-(exact[env] - counts[env]), env))
    for env in by_remainder[:left]:
        counts[env] += 1
    return counts


def mix(rows_by_env: Mapping[str, Sequence[T]], ratios: Mapping[str, float], total: int, seed: int = 0) -> list[T]:
    """`total` rows drawn from several environments at the given ratios, shuffled, deterministic.

    Each environment gets its `allocate` share. An environment with at least that many rows gives a
    random sample without replacement; one with fewer gives all its rows once per full pass, plus a
    sample for the rest (oversampling). Environments absent from `ratios` are not used.
    """
    unknown = sorted(set(ratios) - set(rows_by_env))
    if unknown:
        raise ValueError(f"ratios name environments with no rows given: {', '.join(unknown)}")
    mixed: list[T] = []
    for env, count in allocate(ratios, total).items():
        rows = list(rows_by_env[env])
        if count and not rows:
            raise ValueError(f"environment {env!r} has no rows but a ratio > 0")
        rng = random.Random(f"{seed}:{env}")
        passes, rest = divmod(count, len(rows)) if rows else (0, 0)
        for _ in range(passes):
            mixed.extend(rng.sample(rows, len(rows)))
        mixed.extend(rng.sample(rows, rest))
    random.Random(f"{seed}:mix").shuffle(mixed)
    return mixed


# ---------------------------------------------------------------------------
# The command (its options are declared in rollgym.cli)
# ---------------------------------------------------------------------------


def command(args: Any) -> int:
    try:
        options = ("sort", "min_reward_diff", "initial_percentile", "increment_percentile", "expansion_interval",
                   "random_subsample", "seed")
        config = CurriculumConfig(**{name: getattr(args, name) for name in options if hasattr(args, name)})
    except ValidationError as exc:
        error = exc.errors()[0]
        option = "--" + str(error["loc"][0]).replace("_", "-")
        raise DataError(f"{option}: {error['msg']}") from None
    if args.epoch < 0:
        raise DataError(f"--epoch must be >= 0, got {args.epoch}")
    input_path, output = Path(args.input), Path(args.output)
    if not input_path.is_file():
        raise DataError(f"--input: no such file: {input_path}")

    # Pass 1: each group's rewards and where its lines are; nothing else is kept.
    rewards: dict[str, list[float]] = {}
    spans: dict[str, list[tuple[int, int]]] = {}
    counts = {"skipped": 0, "no_reward": 0}

    def skip(line: int, message: str) -> None:
        counts["skipped"] += 1
        print(f"rollgym: {input_path}:{line}: skipped: {message}", file=sys.stderr)

    for line, start, length, row in iter_jsonl(input_path, skip):
        problem = rollout_problem(row)
        if problem:
            skip(line, problem)
            continue
        if row.get("reward") is None:
            counts["no_reward"] += 1
            continue
        group = group_key(row, line)
        rewards.setdefault(group, []).append(float(row["reward"]))
        spans.setdefault(group, []).append((start, length))

    stages = [_stage("input", rewards, list(rewards))]
    pool: Mapping[str, Sequence[float]] = rewards
    if args.drop_solved or args.drop_unsolved:
        pool = filter_by_difficulty(rewards, drop_all_zero=args.drop_unsolved, drop_all_one=args.drop_solved)
        dropped = " and ".join(w for w, on in (("solved", args.drop_solved), ("unsolved", args.drop_unsolved)) if on)
        stages.append(_stage(f"drop {dropped}", rewards, list(pool)))
    chosen, selection = select_groups_staged(pool, config, args.epoch)
    stages.extend(selection[1:])  # its "input" is the previous stage

    # Pass 2: copy the chosen groups' lines, byte for byte, in curriculum order.
    output.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    with input_path.open("rb") as source, output.open("wb") as sink:
        for group in chosen:
            for start, length in spans[group]:
                source.seek(start)
                data = source.read(length)
                sink.write(data if data.endswith(b"\n") else data + b"\n")
                written += 1

    width = max(len(stage.name) for stage in stages)
    print(f"{'stage':<{width}}  {'groups':>6}  {'rollouts':>8}  mean reward")
    for stage in stages:
        mean = f"{stage.mean_reward:.3f}" if stage.mean_reward is not None else "-"
        print(f"{stage.name:<{width}}  {stage.groups:>6}  {stage.rollouts:>8}  {mean}")
    notes = [f"{counts['skipped']} malformed lines skipped"] if counts["skipped"] else []
    if counts["no_reward"]:
        notes.append(f"{counts['no_reward']} rollouts without a reward ignored")
    if notes:
        print("; ".join(notes))
    print(f"kept {len(chosen)} of {len(rewards)} groups ({written} rollouts) -> {output}")
    return 0


__all__ = ["CurriculumConfig", "Stage", "allocate", "filter_by_difficulty", "mix", "select_groups", "select_groups_staged"]
