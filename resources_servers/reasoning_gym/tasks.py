"""Task rows from a mixture of reasoning-gym generators: deterministic, with a held-out split.

A mixture names generators with a weight and a config each. The rows of a split are shared out by
weight (largest remainder, so 8 rows over weights 2:1:1 are 4, 2 and 2), and each generator walks
its indices from 0: the first distinct questions go to the training split, the next ones to the
validation split. Held-out rows therefore come from other indices of the same dataset, never from
another seed: most generators seed item i with `seed + i`, so seed 1 item 1 is seed 2 item 0, and
"different seeds" would repeat questions. A question is never used twice across both splits (small
configs repeat themselves: leg_counting with one animal has a few dozen questions in all); a
generator that runs out of new questions within its pool is an error that names it.

The same mixture, seed and counts give byte-identical files.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .generators import DEFAULT_PROMPT, GeneratorError, Generators, check_config, check_name, system_prompt

# Indices a generator may try per row it has to give, before it counts as out of new questions.
POOL_PER_ROW = 4
MIN_POOL = 64
# A generator listed twice (two difficulty levels) draws from a seed this far away for each repeat.
SEED_STRIDE = 1_000_000


class DatasetSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="a reasoning-gym generator: leg_counting, basic_arithmetic, ...")
    weight: float = Field(default=1.0, gt=0, description="its share of the rows, relative to the others")
    config: dict[str, Any] = Field(default_factory=dict, description="its config keys (difficulty knobs)")
    seed: int | None = Field(default=None, description="its own seed; default: the mixture's")


class Mixture(BaseModel):
    """A mixture file: generators, their weights and configs, and the rows' prompt and token budget."""

    model_config = ConfigDict(extra="forbid")

    datasets: list[DatasetSpec] = Field(min_length=1)
    seed: int = 0
    system_prompt: str = Field(default=DEFAULT_PROMPT,
                               description="a reasoning-gym prompt name (default, direct, simple, ...) or a text "
                                           "asking for <answer></answer>")
    max_output_tokens: int | None = Field(default=1024, ge=1)

    @field_validator("system_prompt")
    @classmethod
    def _known_prompt(cls, value: str) -> str:
        system_prompt(value)
        return value

    def check(self) -> None:
        """GeneratorError naming `datasets[i].name` / `datasets[i].config.KEY` for the first bad generator."""
        for position, spec in enumerate(self.datasets):
            where = f"datasets[{position}]"
            check_name(spec.name, f"{where}.name")
            check_config(spec.name, spec.config, f"{where}.config")


@dataclass
class Plan:
    """How many rows one generator gives to each split, and from which seed and pool of indices."""

    spec: DatasetSpec
    seed: int
    counts: dict[str, int]
    pool: int = 0
    rows: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def shares(weights: list[float], total: int) -> list[int]:
    """`total` split by weight, largest remainder first (ties to the earlier entry)."""
    exact = [total * weight / sum(weights) for weight in weights]
    counts = [int(value) for value in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def task_row(mixture: Mixture, name: str, config: dict[str, Any], seed: int, size: int, index: int,
             entry: dict[str, Any]) -> dict[str, Any]:
    """One rollgym task row: the system prompt and the question, and what rebuilds and scores the entry."""
    params: dict[str, Any] = {"input": [{"role": "system", "content": system_prompt(mixture.system_prompt)},
                                        {"role": "user", "content": entry["question"]}]}
    if mixture.max_output_tokens is not None:
        params["max_output_tokens"] = mixture.max_output_tokens
    return {"responses_create_params": params, "dataset": name, "dataset_config": config, "seed": seed,
            "size": size, "index": index, "expected_answer": entry["answer"]}


def generate(mixture: Mixture, counts: dict[str, int], generators: Generators | None = None,
             exclude: set[str] | frozenset[str] = frozenset()) -> dict[str, list[dict]]:
    """Rows per split (`counts` = {"train": 200, "validation": 50}, in that order), never a question twice,
    nor one of `exclude` (the questions of task files made before: a held-out set disjoint from them).

    GeneratorError (its field naming the mixture entry) for a bad generator, config, or one that runs
    out of new questions.
    """
    mixture.check()
    generators = generators or Generators(max_datasets=len(mixture.datasets), max_entries=1)
    weights = [spec.weight for spec in mixture.datasets]
    per_split = {split: shares(weights, count) for split, count in counts.items()}
    repeats: dict[str, int] = {}
    plans = []
    for position, spec in enumerate(mixture.datasets):
        repeat = repeats.get(spec.name, 0)
        repeats[spec.name] = repeat + 1
        seed = spec.seed if spec.seed is not None else mixture.seed + SEED_STRIDE * repeat
        plan = Plan(spec, seed, {split: per_split[split][position] for split in counts})
        plan.pool = max(MIN_POOL, POOL_PER_ROW * sum(plan.counts.values()))
        plans.append(plan)
    seen: set[str] = set(exclude)
    for position, plan in enumerate(plans):
        _draw(mixture, plan, position, seen, generators)
    out = {}
    for number, split in enumerate(counts):
        rows = [row for plan in plans for row in plan.rows[split]]
        random.Random(f"{mixture.seed}:{number}:{split}").shuffle(rows)
        out[split] = rows
    return out


def _draw(mixture: Mixture, plan: Plan, position: int, seen: set[str], generators: Generators) -> None:
    spec, where = plan.spec, f"datasets[{position}]"
    index = 0
    for split, wanted in plan.counts.items():
        rows = plan.rows.setdefault(split, [])
        while len(rows) < wanted:
            if index >= plan.pool:
                found = sum(len(made) for made in plan.rows.values())
                raise GeneratorError(
                    f"{spec.name} gave only {found} new questions in its first {plan.pool} indices "
                    f"(needs {sum(plan.counts.values())} new ones): widen its config or ask for fewer rows", where)
            try:
                entry = generators.entry(spec.name, spec.config, plan.seed, plan.pool, index)
            except GeneratorError as exc:
                field = f"{where}.config" if exc.field == "dataset_config" else where
                raise GeneratorError(str(exc), field) from None
            if entry["question"] not in seen:
                seen.add(entry["question"])
                rows.append(task_row(mixture, spec.name, spec.config, plan.seed, plan.pool, index, entry))
            index += 1
