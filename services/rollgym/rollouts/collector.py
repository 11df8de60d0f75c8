"""The rollout collector: tasks JSONL in, one JSON line per finished rollout out, resumable.

Every task is repeated `repeats` times (one `group_id` per task, a stable `rollout_id` per repeat, see
rollgym.rollouts.attempts); a fixed pool of `concurrency` workers bounds the rollouts in flight; each
finished rollout is appended and flushed as it completes (rollgym.rollouts.sink), so a killed run loses
nothing finished and a rerun skips what is already written. Infrastructure failures go to the failures
file and are retried within bounds; they are never written as a reward.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..client import ServerClient
from ..data.jsonl import iter_jsonl
from .attempts import (
    RetryPolicy,
    agent_for,
    build_payload,
    check_agent_refs,
    group_id_for,
    rollout_id_for,
    run_rollout,
)
from .sink import RolloutSink, rollout_line, scan_output


@dataclass
class Task:
    line: int
    row: dict[str, Any]
    group_id: str

    def rollout_id(self, repeat: int) -> str:
        return rollout_id_for(self.group_id, repeat)


@dataclass
class InputProblem:
    line: int
    message: str


@dataclass
class CollectOptions:
    input: Path
    output: Path
    repeats: int = 1
    concurrency: int = 32
    limit: int | None = None
    agent: str | None = None
    params: dict[str, Any] = field(default_factory=dict)  # merged into every responses_create_params
    max_attempts: int = 3
    timeout_s: float = 3600.0
    budget_s: float | None = None  # all the attempts of one rollout, waits included (RetryPolicy.budget_s)
    pass_threshold: float = 1.0
    progress: bool = True
    force_agent: bool = False  # every row to the collector's agent, whatever its agent_ref names
    skip_verification: bool = False  # agents skip /verify: rollouts with reward null, verification "skipped"


def row_problem(row: dict[str, Any]) -> str | None:
    """What makes a task row unusable at a glance, or None.

    Only the shape is checked here, so the collector starts without the schema's imports; the agent
    validates every field and refuses a bad row with a 4xx naming it, recorded once as `rejected`.
    """
    params = row.get("responses_create_params")
    if not isinstance(params, dict):
        return "field 'responses_create_params': required, a JSON object"
    if not isinstance(params.get("input"), (str, list)):
        return "field 'responses_create_params.input': required, a string or a list of items"
    return None


def read_tasks(path: Path, limit: int | None = None) -> tuple[list[Task], list[InputProblem]]:
    """Valid task rows with their group ids, and the problems of the lines that are not."""
    tasks: list[Task] = []
    problems: list[InputProblem] = []
    if limit is not None and limit <= 0:
        return tasks, problems
    for line in iter_jsonl(path, lambda number, message: problems.append(InputProblem(number, message))):
        problem = row_problem(line.row)
        if problem:
            problems.append(InputProblem(line.number, problem))
            continue
        tasks.append(Task(line.number, line.row, group_id_for(line.row, line.number)))
        if limit is not None and len(tasks) >= limit:
            break  # the lines after the limit are not read, nor reported
    return tasks, problems


class Collector:
    """Runs a collection against an agent server (by registry name or URL)."""

    def __init__(self, client: ServerClient, agent: str, options: CollectOptions,
                 log: Callable[[str], None] = print) -> None:
        self.client = client
        self.agent = agent
        self.options = options
        self.log = log
        self.policy = retry_policy(options)

    async def run(self) -> dict[str, Any]:
        """Collect every missing rollout; returns the metrics summary (also written to disk)."""
        options = self.options
        tasks, problems = read_tasks(options.input, options.limit)
        check_routes(tasks, self.client.registry, options, self.agent)
        for problem in problems:
            self.log(f"{options.input}:{problem.line}: skipped: {problem.message}")
        options.output.parent.mkdir(parents=True, exist_ok=True)
        done, note = scan_output(options.output)
        if note:
            self.log(note)
        total = len(tasks) * options.repeats
        remaining = sum(1 for task in tasks for k in range(options.repeats) if task.rollout_id(k) not in done)
        if done:
            self.log(f"resuming: {total - remaining} of {total} rollouts already in {options.output}")
        # One shared iterator feeds a fixed pool of workers: memory stays O(concurrency), not O(rollouts).
        jobs = ((task, k) for task in tasks for k in range(options.repeats) if task.rollout_id(k) not in done)
        sink = RolloutSink(options.output, done=done, total=total, repeats=options.repeats,
                           pass_threshold=options.pass_threshold, progress=options.progress, log=self.log)

        async def worker() -> None:
            for task, repeat in jobs:
                rollout, _ = await self.rollout(task, repeat, lambda failed: sink.failure(failed.to_json()))
                if rollout is not None:
                    sink.rollout(rollout)

        try:
            async with asyncio.TaskGroup() as group:
                for _ in range(min(options.concurrency, remaining)):
                    group.create_task(worker())
        finally:
            summary = sink.close(skipped_lines=len(problems))
        return summary

    async def rollout(self, task: Task, repeat: int, on_failure: Callable[[Any], None]) -> tuple[dict[str, Any] | None, Any]:
        """One rollout of `task` under the run's retry policy (rollgym.rollouts.attempts.run_rollout)."""
        payload = build_payload(task.row, self.options.params, task.group_id, task.rollout_id(repeat),
                                skip_verification=self.options.skip_verification)
        agent = self.agent if self.options.force_agent else agent_for(task.row, self.agent)
        rollout, attempt = await run_rollout(self.client, agent, payload, self.policy,
                                             where={"line": task.line}, on_failure=on_failure)
        return (rollout_line(rollout, task.row) if rollout is not None else None), attempt


def check_routes(tasks: list[Task], registry: dict[str, Any], options: CollectOptions, default: str) -> None:
    """Before anything is sent: every row's agent_ref names an agent of the stack (UnknownAgent if not)."""
    if not options.force_agent:
        check_agent_refs(((f"{options.input}:{task.line}", task.row) for task in tasks), registry,
                         every_row_named=not default)


def retry_policy(options: CollectOptions) -> RetryPolicy:
    return RetryPolicy(max_attempts=options.max_attempts, timeout_s=options.timeout_s, budget_s=options.budget_s)
