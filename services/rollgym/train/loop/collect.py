"""The collect phase, and every collection the loop makes through its stack (validation's too).

A collection is `rollgym collect-rollouts` in-process (`rollouts.collector`): resumable by rollout_id,
bounded retries, failures to their own file. Here it gets the plan's concurrency, attempt timeout and
retry bounds, the served model's name (so that a hot-loaded adapter or the base weights answer), and the
run's agent. A collection in which every rollout failed raises, with the first cause, and is not
recorded as done, so that a rerun once the stack is right collects again instead of finding nothing.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any, Callable

from ...client import ServerClient
from ...data.jsonl import read_whole_lines
from ...data.sampling import params_at, temperature_schedule
from ...rollouts.collector import CollectOptions, Collector, read_tasks
from .apply import Serving
from .dynamic_sampling import group_counts, refill_tasks, write_tasks
from .errors import TrainError
from .plan import Plan, StageConfig


def _counts(counts: Any) -> str:
    return ", ".join(f"{status}: {n}" for status, n in counts.items()) if isinstance(counts, dict) else "?"


def _first_failure(path: str | None) -> str:
    """The cause of the first failed attempt in a collection's failures file."""
    rows = read_whole_lines(Path(path)) if path else []
    return str(rows[0].get("error") or rows[0].get("status")) if rows else "no cause recorded"


class Collections:
    """Collections through the plan's stack, as the loop's phases make them."""

    def __init__(self, plan: Plan, serving: Serving, *, progress: bool, log: Callable[[str], None]) -> None:
        self.plan = plan
        self.serving = serving
        self.progress = progress
        self.log = log

    def options(self, tasks: Path, output: Path, *, repeats: int, limit: int | None, params: dict[str, Any],
                pass_threshold: float = 1.0) -> CollectOptions:
        """A collection's options: the stack section's concurrency, attempt timeout and retry bounds, and
        the served model's name in every request."""
        stack = self.plan.stack
        return CollectOptions(input=tasks, output=output, repeats=repeats, limit=limit,
                              params={**params, **self.serving.request_params()}, pass_threshold=pass_threshold,
                              progress=self.progress, concurrency=stack.concurrency, timeout_s=stack.timeout_s,
                              max_attempts=stack.max_attempts, budget_s=stack.budget_s)

    def collect(self, epoch: int, stage: StageConfig, folder: Path, level: int) -> dict[str, Any]:
        """The collect phase of an epoch: the stage's tasks (of its curriculum level) into rollouts.jsonl."""
        if stage.collect is None:  # a replay-only stage trains offline
            return {"rollouts": 0, "failed": 0, "replay": list(stage.replay)}
        # A temperature schedule runs over the stage's epochs: its first at the start, its last at the end.
        step = [each.name for _, each in self.plan.epochs()][: epoch - 1].count(stage.name)
        params = params_at(stage.collect.params, step, stage.epochs - 1)
        options = self.options(Path(stage.collect.files[level]), folder / "rollouts.jsonl",
                               repeats=stage.collect.repeats, limit=stage.collect.limit, params=params)
        options.skip_verification = stage.collect.skip_verification
        summary = self.run(options, f"epoch {epoch} collect")
        if stage.collect.difficulty.enabled:
            summary["dynamic_sampling"] = self.refill(epoch, stage, folder, level, params)
        if temperature_schedule(stage.collect.params) is not None:
            summary["temperature"] = params["temperature"]
        return summary

    def refill(self, epoch: int, stage: StageConfig, folder: Path, level: int,
               params: dict[str, Any]) -> dict[str, Any]:
        """Dynamic sampling (`collect.difficulty`, dynamic_sampling.py): refill rounds after the planned
        collection until its number of groups with a reward spread is kept; what they did, for history."""
        collect = stage.collect
        assert collect is not None
        tasks, _ = read_tasks(Path(collect.files[level]))
        planned = used = min(collect.limit or len(tasks), len(tasks))
        files, stopped = [folder / "rollouts.jsonl"], None
        collected = kept = spread = 0
        while True:
            counts = group_counts(files, stage.curate, collect.repeats)
            if counts is None:
                stopped = "curation failed"
                break
            collected, kept, spread = counts
            if kept >= planned:
                break
            fresh = refill_tasks(tasks, used, planned - kept, collect.difficulty)
            if len(files) > collect.difficulty.max_refill_rounds or not fresh:
                stopped = "max_refill_rounds" if fresh else "no tasks left"
                break
            used += len(fresh)
            write_tasks(folder / f"refill-{len(files)}.tasks.jsonl", fresh)
            options = self.options(folder / f"refill-{len(files)}.tasks.jsonl", folder / f"refill-{len(files)}.jsonl",
                                   repeats=collect.repeats, limit=None, params=params)
            self.run(options, f"epoch {epoch} refill {len(files)}: {len(fresh)} tasks, {planned - kept} groups missing")
            files.append(options.output)
        if stopped:
            self.log(f"epoch {epoch} ({stage.name}): {kept} of {planned} planned groups have a reward spread after "
                     f"{len(files) - 1} refill rounds ({stopped})")
        return {"planned": planned, "groups_collected": collected, "groups_kept": kept,
                "groups_dropped_zero_spread": spread, "refill_rounds": len(files) - 1, "stopped": stopped}

    def run(self, options: CollectOptions, label: str, agent: str | None = None) -> dict[str, Any]:
        """One collection; its summary (rollouts, groups, failed, mean reward, pass@k, statuses)."""
        if not options.input.is_file():
            raise TrainError(f"{label}: no such task file: {options.input}")
        agent = agent or self.agent()

        async def collect() -> dict[str, Any]:
            client = ServerClient(self.serving.registry, timeout_s=options.timeout_s, max_retries=2)
            try:
                return await Collector(client, agent, options, log=self.log).run()
            finally:
                await client.close()

        if self.progress:
            print(f"{label}:", file=sys.stderr)
        summary = asyncio.run(collect())
        if summary.get("failed") and not summary.get("rollouts"):
            failures = summary.get("run", {}).get("failures")
            raise TrainError(f"{label}: every rollout failed ({_counts(summary.get('status_counts'))}), e.g. "
                                  f"{_first_failure(failures)}; all causes in {failures}")
        keep = ("rollouts", "groups", "failed", "unverified", "mean_reward", "reward_std", "status_counts")
        return {k: v for k, v in summary.items() if k in keep or k.startswith("pass@")}

    def agent(self) -> str:
        """The agent the plan names, or the stack's only one."""
        wanted = self.plan.stack.agent
        agents = [name for name, address in self.serving.registry.items() if address.role in ("agents", "")]
        if wanted:
            if wanted not in self.serving.registry:
                raise TrainError(f"stack.agent: no server named {wanted!r} (agents: {', '.join(agents)})")
            return wanted
        if len(agents) != 1:
            raise TrainError(f"stack.agent: the stack has {len(agents)} agents ({', '.join(agents)}); name one")
        return agents[0]


__all__ = ["Collections"]
