"""Each policy's validation before → after of `rollgym train` runs with several policies (docs/train-policies.md),
with `rollgym eval`'s statistics: each policy's own mean reward (its `rewards[ROLE]`, else the episode's) and
its 95 % interval over tasks, the paired difference over the same held-out tasks (beyond noise when its
interval leaves out 0), and each epoch's train reward of that policy (groups trained on). One markdown row per
run and policy.

    python scripts/train/policy_gain.py runs/relay-policies-s1 runs/relay-policies-s2 ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import orjson

from rollgym.eval.stats import TaskResult, compare_tasks, mean_reward
from rollgym.train.loop.policies import PolicyConfig, policy_rollouts


def tasks(path: Path, policy: PolicyConfig, credit: str) -> dict[str, TaskResult]:
    """A validation file's finished rollouts by task (group_id), each with the policy's own reward."""
    rows = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    views, _ = policy_rollouts(rows, policy, credit)  # type: ignore[arg-type]
    rewards: dict[str, list[float]] = {}
    for view in views:
        if view.get("reward") is not None:
            rewards.setdefault(str(view["group_id"]), []).append(float(view["reward"]))
    return {task: TaskResult(task, tuple(values)) for task, values in rewards.items()}


def rows(run: Path) -> list[str]:
    history = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines() if line.strip()]
    plan = orjson.loads((run / "plan.json").read_bytes()) if (run / "plan.json").is_file() else {}
    policies = [PolicyConfig.model_validate(p) for p in plan.get("policies") or []]
    validated = [line["epoch"] for line in history if line.get("validation")]
    if not policies or len(validated) < 2:
        return [f"| {run.name} | not finished, or one policy ({len(history)} history lines) | | | | | |"]
    files = [run / f"epoch-{epoch:03d}" / "validation.jsonl" for epoch in (validated[0], validated[-1])]
    out = []
    for policy in policies:
        before, after = (tasks(file, policy, plan.get("credit", "per_role")) for file in files)
        a, b, diff = mean_reward(before.values()), mean_reward(after.values()), compare_tasks(before, after)
        assert a is not None and b is not None and diff is not None
        trained = " → ".join(f"{own['train']['mean_reward']:.2f} ({own['curated'].get('records', 0)})"
                             for line in history if (own := (line.get("policies") or {}).get(policy.name))
                             and own.get("train"))
        verdict = "**rises**" if (diff.low or 0) > 0 else ("falls" if (diff.high or 0) < 0 else "within noise")
        out.append(f"| {run.name} | {policy.name} | {a.value:.3f} [{a.low:.2f}, {a.high:.2f}] "
                   f"| {b.value:.3f} [{b.low:.2f}, {b.high:.2f}] "
                   f"| {diff.difference:+.3f} [{diff.low:+.2f}, {diff.high:+.2f}] | {verdict} | {trained} |")
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv else 2
    missing = [arg for arg in argv if not (Path(arg) / "history.jsonl").is_file()]
    if missing:
        print(f"policy_gain.py: no history.jsonl in {', '.join(missing)} (give rollgym train output folders)",
              file=sys.stderr)
        return 2
    print("| run | policy | before (epoch 0) [95 % CI] | after [95 % CI] | after − before, paired [95 % CI] | verdict "
          "| its train reward (records trained) per epoch |")
    print("|---|---|---|---|---|---|---|")
    for arg in argv:
        print("\n".join(rows(Path(arg))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
