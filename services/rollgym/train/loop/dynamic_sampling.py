"""Dynamic sampling in epochs mode (DAPO's dynamic sampling, the online difficulty filter of the async
orchestrator, `orchestrator/groups.py`): a group whose rewards are all alike teaches GRPO nothing, and
curation drops it (`zero_reward_spread`, or `low_reward_spread` under `curate.min_reward_spread`). With
`collect.difficulty.enabled`, the collect phase counts the groups curation would keep and, while fewer than
the planned ones (`collect.limit`, else every task of the file) are left, collects fresh ones from the task
file's next rows: `ceil(missing * oversampling_factor)` tasks a round, at most `max_refill_rounds` rounds.
The rounds run in `collect.Collections.refill`; this module holds the check of the section (the one
`DifficultyConfig` of both modes, rollgym.data.rollout_filters) and the counting. A refill round's rollouts go to
`refill-N.jsonl` beside `rollouts.jsonl` (its tasks to
`refill-N.tasks.jsonl`, each row with the group_id of its line in the task file), and curation reads
them all. The bound, or a task file with no rows left, stops the refills: counted in history
(`dynamic_sampling`), never a failure; an epoch left with nothing to train on is skipped as before.
"""

from __future__ import annotations

import math
from pathlib import Path

import orjson

from ...data.jsonl import read_whole_lines
from ...data.rollout_filters import DifficultyConfig
from ...rollouts.collector import Task
from .curation import CurateConfig, CurationError, curate

SPREAD_DROPS = ("zero_reward_spread", "low_reward_spread")


def difficulty_problem(difficulty: DifficultyConfig, data: str | None, trainer: str) -> str | None:
    """Why a stage cannot refill groups (None: it can, or it does not ask to)."""
    if keys := difficulty.other_mode_keys("epochs"):
        return (f"collect.difficulty: {', '.join(keys)} apply in mode: async (orchestrator.difficulty); an epoch "
                "refills the groups curation drops for no reward spread")
    if difficulty.enabled and data != "groups":
        return f"collect.difficulty.enabled: refills groups for a trainer of groups (grpo); {trainer} trains on {data}"
    return None


def epoch_files(folder: Path) -> list[Path]:
    """An epoch's rollouts files: the planned collection's, then each refill round's."""
    files = [folder / "rollouts.jsonl"]
    while (folder / f"refill-{len(files)}.jsonl").is_file():
        files.append(folder / f"refill-{len(files)}.jsonl")
    return files


def group_counts(files: list[Path], curation: CurateConfig, repeats: int) -> tuple[int, int, int] | None:
    """(groups collected, groups curation keeps, groups it drops for no reward spread) in `files`; None
    where curation fails (no token sequences: the curate phase says so)."""
    rollouts = [row for file in files for row in read_whole_lines(file)]
    try:
        curated = curate(rollouts, "groups", curation, group_size=repeats)
    except CurationError:
        return None
    collected = len({str(r.get("group_id") or r.get("rollout_id")) for r in rollouts})
    spread = sum(curated.dropped.get(reason, 0) for reason in SPREAD_DROPS) // repeats
    return collected, len(curated.records), spread


def refill_tasks(tasks: list[Task], used: int, missing: int, difficulty: DifficultyConfig) -> list[Task]:
    """The next round's tasks: the file's rows after the `used` ones, `ceil(missing * oversampling_factor)`."""
    return tasks[used: used + math.ceil(missing * difficulty.oversampling_factor)]


def write_tasks(path: Path, tasks: list[Task]) -> None:
    """A round's task file, each row with the group_id of its line in the stage's task file."""
    path.write_bytes(b"".join(orjson.dumps({**task.row, "group_id": task.group_id}) + b"\n" for task in tasks))


__all__ = ["difficulty_problem", "epoch_files", "group_counts", "refill_tasks", "write_tasks"]
