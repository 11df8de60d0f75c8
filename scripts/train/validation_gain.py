"""Validation before → after of `rollgym train` runs, with `rollgym eval`'s statistics: each mean reward
(with the history's reward_std over rollouts) and its 95 % interval over tasks, the paired difference over
the same held-out tasks (beyond noise when its interval leaves out 0), how many validation replies finished
(were not cut off at the token limit) before and after, and each epoch's train reward and groups trained
on (an async run: each step's collected reward). One markdown row per run.

    python scripts/train/validation_gain.py runs/rg-grpo-products-s1 runs/rg-grpo-products-s2 ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from rollgym.eval.stats import TaskResult, compare_tasks, mean_reward


def tasks(path: Path) -> dict[str, TaskResult]:
    """A validation file's finished rollouts by task (group_id)."""
    rewards: dict[str, list[float]] = {}
    for line in path.read_bytes().splitlines():
        row = orjson.loads(line) if line.strip() else None
        if row and row.get("reward") is not None:
            rewards.setdefault(str(row["group_id"]), []).append(float(row["reward"]))
    return {task: TaskResult(task, tuple(values)) for task, values in rewards.items()}


def finished(path: Path) -> str:
    """'finished of all' validation rollouts: those that ended on their own, not at the token limit."""
    statuses = [orjson.loads(line).get("status") for line in path.read_bytes().splitlines() if line.strip()]
    return f"{statuses.count('ok')}/{len(statuses)}"


def row(run: Path) -> str:
    history = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines() if line.strip()]
    unit = "step" if any(line.get("stage") == "async" for line in history) else "epoch"
    validated = [line[unit] for line in history if line.get("validation")]
    if len(validated) < 2:
        return f"| {run.name} | not finished ({len(history)} history lines) | | | | | |"
    first, last = validated[0], validated[-1]
    files = [run / f"{unit}-{number:03d}" / "validation.jsonl" for number in (first, last)]
    before, after = tasks(files[0]), tasks(files[1])
    a, b = mean_reward(before.values()), mean_reward(after.values())
    diff = compare_tasks(before, after)
    assert a is not None and b is not None and diff is not None
    sd = {line[unit]: line["validation"].get("reward_std", 0.0) for line in history if line.get("validation")}
    # A run of several policies has each policy's curation under `policies` (scripts/train/policy_gain.py).
    if unit == "step":
        trained = " → ".join(f"{line['orchestrator']['reward_mean']:.2f}" for line in history
                             if line.get("orchestrator"))
    else:
        trained = " → ".join(f"{line['train']['mean_reward']:.2f} ({line.get('curated', {}).get('records', '-')})"
                             for line in history if line.get("train"))
    verdict = "**rises**" if (diff.low or 0) > 0 else ("falls" if (diff.high or 0) < 0 else "within noise")
    return (f"| {run.name} | {a.value:.3f} ±{sd[first]:.2f} [{a.low:.2f}, {a.high:.2f}] "
            f"| {b.value:.3f} ±{sd[last]:.2f} [{b.low:.2f}, {b.high:.2f}] "
            f"| {diff.difference:+.3f} [{diff.low:+.2f}, {diff.high:+.2f}] | {verdict} "
            f"| {finished(files[0])} → {finished(files[1])} | {trained} |")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv else 2
    missing = [arg for arg in argv if not (Path(arg) / "history.jsonl").is_file()]
    if missing:
        print(f"validation_gain.py: no history.jsonl in {', '.join(missing)} (give rollgym train output folders)",
              file=sys.stderr)
        return 2
    print("| run | before (epoch 0) ±sd [95 % CI] | after ±sd [95 % CI] | after − before, paired [95 % CI] | verdict "
          "| replies finished | train reward (groups trained) per epoch |")
    print("|---|---|---|---|---|---|---|")
    for arg in argv:
        print(row(Path(arg)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
