"""Where the orchestrator's tasks come from: one source per environment, deduplicated, mixed by ratio.

- **Dedupe.** Two task rows are the same task when the values at the configured `hash_keys` (dotted
  paths, e.g. `responses_create_params.input`) are equal; a row that has none of the keys is hashed
  whole. Only the first of a set of duplicates is used; the others are counted and skipped, across
  all environments.
- **Order.** Each source walks its tasks in a fresh seeded permutation per epoch and wraps around, so a
  run can take any number of steps. Its state for a resume is its position (`epoch`, `position`), the
  tasks dispatched but not yet used in a batch (`pending`: sent first after a resume, so none is
  skipped), and its difficulty pools.
- **Difficulty pools.** A task the difficulty filter finds too easy or too hard leaves the rotation for
  the `easy` or `hard` pool; at the start of each pass over the tasks every pooled task comes back
  with probability `easy_fraction` / `hard_fraction` (seeded), to be judged again. Over a long run
  the tasks that teach nothing are re-sent at that rate instead of on every pass. A source whose
  every task is pooled raises `SourceExhausted`.
- **Ratios.** Every step's `groups_per_step` group slots are dealt to environments in proportion to
  their ratios by largest deficit first: slot `t` goes to the environment whose count falls furthest
  behind `ratio * (t + 1)`. Each step's mix is then fixed in advance, and over any run of steps an
  environment's count stays within one group of its exact share.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import orjson

from ...rollouts.collector import read_tasks

_MISSING = object()


def task_hash(row: Mapping[str, Any], hash_keys: Sequence[str]) -> str:
    """The identity of a task row under `hash_keys` (the whole row when it has none of them)."""
    values = [_lookup(row, key) for key in hash_keys]
    if all(value is _MISSING for value in values):
        payload: Any = row
    else:
        payload = [None if value is _MISSING else value for value in values]
    return hashlib.sha1(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _lookup(row: Mapping[str, Any], dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


@dataclass
class SourceTask:
    """One usable task row of an environment, with the group id the collector would give it."""

    env: str
    group_id: str
    row: dict[str, Any]
    index: int = 0  # its place in the environment's task list


POOLS = ("easy", "hard")


class SourceExhausted(ValueError):
    """Every task of an environment sits in a difficulty pool: nothing is left to send."""


class TaskSource:
    """The tasks of one environment in a seeded order per epoch, endlessly, less the pooled ones."""

    def __init__(self, env: str, tasks: list[SourceTask], seed: int, shuffle: bool = True,
                 promote: Mapping[str, float] | None = None) -> None:
        if not tasks:
            raise ValueError(f"environment {env!r} has no tasks to train on")
        self.env = env
        self.tasks = tasks
        for index, task in enumerate(tasks):
            task.index = index
        self.seed = seed
        self.shuffle = shuffle
        self.promote = dict(promote or {})  # pool -> chance a pooled task returns at each new pass
        self.epoch = 0
        self.position = 0
        self.pools: dict[str, set[int]] = {pool: set() for pool in POOLS}
        self._again: list[int] = []  # dispatched before a resume but never used: sent first
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(len(self.tasks)))
        if self.shuffle:
            random.Random(f"{self.seed}:{self.env}:{epoch}").shuffle(order)
        return order

    def next(self) -> SourceTask:
        if self._again:
            return self.tasks[self._again.pop(0)]
        pooled = set().union(*self.pools.values())
        if len(pooled) >= len(self.tasks):
            raise SourceExhausted(f"environment {self.env!r}: all {len(self.tasks)} tasks are in the difficulty "
                                  f"pools (easy {len(self.pools['easy'])}, hard {len(self.pools['hard'])}); "
                                  "loosen the difficulty filter or raise easy_fraction / hard_fraction")
        while True:
            if self.position >= len(self.tasks):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
                self._promote()
            index = self._order[self.position]
            self.position += 1
            if not any(index in pool for pool in self.pools.values()):
                return self.tasks[index]

    def retire(self, task: SourceTask, pool: str) -> None:
        """Take a task out of the rotation into the `easy` or `hard` pool."""
        self.pools[pool].add(task.index)

    def _promote(self) -> None:
        """At a new pass, each pooled task returns with its pool's chance (seeded by the pass)."""
        rng = random.Random(f"{self.seed}:{self.env}:{self.epoch}:pools")
        for pool, members in self.pools.items():
            chance = self.promote.get(pool, 0.0)
            members.difference_update({index for index in sorted(members) if rng.random() < chance})

    def state(self, pending: Sequence[SourceTask] = ()) -> dict[str, Any]:
        """Where the source stands; `pending`: tasks handed out but not used yet, to send again after a resume."""
        return {"epoch": self.epoch, "position": self.position, "pending": self._again + [t.index for t in pending],
                **{pool: sorted(members) for pool, members in self.pools.items()}}

    def restore(self, state: Mapping[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
        size = len(self.tasks)
        self._again = [int(i) for i in state.get("pending", []) if 0 <= int(i) < size]
        self.pools = {pool: {int(i) for i in state.get(pool, []) if 0 <= int(i) < size} for pool in POOLS}


def load_sources(envs: Sequence[tuple[str, Path, int | None]], hash_keys: Sequence[str], seed: int,
                 shuffle: bool = True, promote: Mapping[str, float] | None = None
                 ) -> tuple[dict[str, TaskSource], dict[str, Any]]:
    """One TaskSource per (name, tasks file, limit), duplicates removed across all of them.

    Returns the sources and a report: `duplicates` per environment and the `skipped` bad lines
    (`file:line: why`). Raises ValueError when an environment is left without tasks.
    """
    seen: set[str] = set()
    sources: dict[str, TaskSource] = {}
    report: dict[str, Any] = {"duplicates": {}, "skipped": []}
    for name, path, limit in envs:
        if not path.is_file():
            raise ValueError(f"environment {name!r}: tasks file {path} does not exist")
        rows, problems = read_tasks(path, limit)
        report["skipped"] += [f"{path}:{problem.line}: {problem.message}" for problem in problems]
        kept = []
        for task in rows:
            identity = task_hash(task.row, hash_keys)
            if identity in seen:
                continue
            seen.add(identity)
            kept.append(SourceTask(name, task.group_id, task.row))
        report["duplicates"][name] = len(rows) - len(kept)
        if not kept:
            raise ValueError(f"environment {name!r}: no usable tasks in {path} "
                             f"({len(rows)} rows, {len(rows) - len(kept)} duplicates, {len(problems)} bad lines)")
        sources[name] = TaskSource(name, kept, seed, shuffle, promote)
    return sources, report


class EnvMixer:
    """Deals each step's group slots to environments by ratio (largest deficit first)."""

    def __init__(self, ratios: Mapping[str, float], groups_per_step: int) -> None:
        total = sum(ratios.values())
        if total <= 0 or any(r < 0 for r in ratios.values()):
            raise ValueError("environment ratios must be non-negative and not all zero")
        self.weights = {name: r / total for name, r in ratios.items()}
        self.groups_per_step = groups_per_step
        self._counts = {name: 0 for name in ratios}
        self._slots = 0
        self._quotas: list[dict[str, int]] = []  # per step from 1, as dealt so far

    def _deal(self) -> str:
        t = self._slots + 1
        name = max(self.weights, key=lambda n: self.weights[n] * t - self._counts[n])
        self._counts[name] += 1
        self._slots = t
        return name

    def quotas(self, step: int) -> dict[str, int]:
        """How many groups of each environment step `step` (from 1) holds; they sum to groups_per_step."""
        while len(self._quotas) < step:
            quota = {name: 0 for name in self.weights}
            for _ in range(self.groups_per_step):
                quota[self._deal()] += 1
            self._quotas.append(quota)
        return dict(self._quotas[step - 1])


__all__ = ["EnvMixer", "SourceExhausted", "SourceTask", "TaskSource", "load_sources", "task_hash"]
