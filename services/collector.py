"""The rollout collector: tasks JSONL in, one JSON line per finished rollout out, resumable.

Every task is repeated `repeats` times (one `group_id` per task, a stable `rollout_id` per repeat);
a fixed pool of `concurrency` workers bounds the rollouts in flight; each finished rollout is appended and flushed as it
completes, so a killed run loses nothing finished and a rerun skips what is already written.
Infrastructure failures go to the failures file and are retried within bounds; they are never
written as a reward.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

import orjson

from .client import ServerCallError, ServerClient
from .metrics import RolloutRecord, summarize
from .statuses import FAILURE_STATUSES


@dataclass
class Task:
    line: int
    row: dict[str, Any]
    group_id: str

    def rollout_id(self, repeat: int) -> str:
        return f"{self.group_id}-r{repeat}"


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
    pass_threshold: float = 1.0
    progress: bool = True


def companion_paths(output: Path) -> tuple[Path, Path]:
    """`rollouts.jsonl` → (`rollouts.failures.jsonl`, `rollouts.metrics.json`)."""
    stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    return stem.with_name(stem.name + ".failures.jsonl"), stem.with_name(stem.name + ".metrics.json")


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
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if limit is not None and len(tasks) >= limit:
                break
            if not raw.strip():
                continue
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError as exc:
                problems.append(InputProblem(line_number, f"not valid JSON: {exc}"))
                continue
            if not isinstance(row, dict):
                problems.append(InputProblem(line_number, f"expected a JSON object, got {type(row).__name__}"))
                continue
            problem = row_problem(row)
            if problem:
                problems.append(InputProblem(line_number, problem))
                continue
            # Stable across reruns of the same file; the hash keeps an edited line from being skipped.
            digest = hashlib.sha1(orjson.dumps(row, option=orjson.OPT_SORT_KEYS)).hexdigest()[:8]
            group_id = str(row.get("group_id") or f"L{line_number:06d}-{digest}")
            tasks.append(Task(line_number, row, group_id))
    return tasks, problems


def repair_torn_tail(path: Path) -> str | None:
    """Cut a last line that lacks its newline (a write cut short by a kill); returns a note if it did."""
    if not path.exists():
        return None
    with path.open("r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        keep, end = 0, size
        while end > 0:  # the last newline, reading backwards in blocks
            start = max(0, end - 65536)
            handle.seek(start)
            newline = handle.read(end - start).rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        if keep == size:
            return None
        handle.truncate(keep)
    return f"repaired a torn last line ({size - keep} bytes) in {path}"


def scan_output(path: Path) -> tuple[dict[str, RolloutRecord], str | None]:
    """The rollouts already written (by rollout_id), repairing a torn last line from a kill.

    Returns (records, repair note). A last line without its newline, or one that does not parse,
    was cut by a crash mid-write: it is truncated away (its rollout is simply run again).
    """
    records: dict[str, RolloutRecord] = {}
    if not path.exists():
        return records, None
    data = path.read_bytes()
    note = None
    end = len(data)
    if data and not data.endswith(b"\n"):
        end = data.rfind(b"\n") + 1
        note = f"repaired a torn last line ({len(data) - end} bytes) in {path}"
    good_end = 0
    position = 0
    while position < end:
        newline = data.index(b"\n", position)
        line = data[position:newline]
        position = newline + 1
        if not line.strip():
            good_end = position
            continue
        try:
            rollout = orjson.loads(line)
            rollout_id = str(rollout["rollout_id"])
        except (orjson.JSONDecodeError, KeyError, TypeError):
            if position >= end:  # a garbled last line is a torn write too
                note = f"repaired an unreadable last line in {path}"
                break
            line_number = data.count(b"\n", 0, position)
            raise ValueError(f"{path}: line {line_number} is not a rollout; refusing to resume over it") from None
        records[rollout_id] = RolloutRecord.from_rollout(rollout)
        good_end = position
    if good_end != len(data):
        with path.open("r+b") as handle:
            handle.truncate(good_end)
    return records, note


@dataclass
class Attempt:
    """One POST /run, classified: a verified rollout, or a failure's status and cause."""

    rollout: dict[str, Any] | None
    status: str
    error: str | None = None
    retryable: bool = True


async def attempt_run(client: ServerClient, agent: str, payload: dict[str, Any], timeout_s: float) -> Attempt:
    """Send one task row to an agent's /run and say what came back.

    A rollout counts only with a policy status and a numeric reward; an infrastructure status, an
    unreachable or failing agent, or an answer without a reward is a failure (never a reward of 0).
    A 4xx means the task row itself was refused ("rejected"): retrying cannot help.
    """
    try:
        reply = await client.post(agent, "/run", json=payload, timeout_s=timeout_s)
    except ServerCallError as exc:
        return Attempt(None, "timeout" if exc.kind == "timeout" else "agent_error", str(exc),
                       retryable=exc.kind != "unknown_server")
    if not reply.ok:
        status = "rejected" if 400 <= reply.status < 500 else "agent_error"
        return Attempt(None, status, f"HTTP {reply.status}: {reply.error_message()}", retryable=status != "rejected")
    rollout = reply.json()
    status = str(rollout.get("status", "ok"))
    if status in FAILURE_STATUSES:
        return Attempt(None, status, rollout.get("error"))
    if not isinstance(rollout.get("reward"), (int, float)):
        return Attempt(None, "agent_error", f"the agent answered status {status!r} without a reward")
    return Attempt(rollout, status)


class Collector:
    """Runs a collection against an agent server (by registry name or URL)."""

    def __init__(self, client: ServerClient, agent: str, options: CollectOptions,
                 log: Callable[[str], None] = print) -> None:
        self.client = client
        self.agent = agent
        self.options = options
        self.log = log
        self.failure_statuses: Counter = Counter()
        self.failed_final = 0
        self.written = 0

    async def run(self) -> dict[str, Any]:
        """Collect every missing rollout; returns the metrics summary (also written to disk)."""
        options = self.options
        tasks, problems = read_tasks(options.input, options.limit)
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
        failures_path, metrics_path = companion_paths(options.output)
        failures_note = repair_torn_tail(failures_path)
        if failures_note:
            self.log(failures_note)
        started = time.perf_counter()
        records = dict(done)
        bar = _progress_bar(total, total - remaining, options.progress)
        reward_sum = sum(r.reward for r in records.values())
        with options.output.open("ab") as out, failures_path.open("ab") as failures:

            async def worker() -> None:
                nonlocal reward_sum
                for task, repeat in jobs:
                    rollout = await self._rollout(task, repeat, failures)
                    if rollout is not None:
                        out.write(orjson.dumps(rollout, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
                        out.flush()
                        record = RolloutRecord.from_rollout(rollout)
                        records[rollout["rollout_id"]] = record
                        reward_sum += record.reward
                        self.written += 1
                    bar.update(1)
                    bar.set_postfix(mean_reward=_mean(reward_sum, len(records)), failed=self.failed_final, refresh=False)

            try:
                async with asyncio.TaskGroup() as group:
                    for _ in range(min(options.concurrency, remaining)):
                        group.create_task(worker())
            finally:
                bar.close()
                os.fsync(out.fileno())
        elapsed = time.perf_counter() - started
        summary = summarize(
            records.values(), repeats=options.repeats, pass_threshold=options.pass_threshold,
            failed=self.failed_final, failure_statuses=self.failure_statuses,
        )
        summary["run"] = {
            "new_rollouts": self.written,
            "skipped_lines": len(problems),
            "wall_s": round(elapsed, 3),
            "rollouts_per_s": round(self.written / elapsed, 2) if elapsed > 0 else None,
            "output": str(options.output),
            "failures": str(failures_path),
        }
        metrics_path.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
        return summary

    async def _rollout(self, task: Task, repeat: int, failures: BinaryIO) -> dict[str, Any] | None:
        """One rollout with bounded retries of infrastructure failures; None if it never succeeded."""
        options = self.options
        rollout_id = task.rollout_id(repeat)
        payload = dict(task.row)
        if options.params:
            payload["responses_create_params"] = {**task.row["responses_create_params"], **options.params}
        payload["rollout_id"] = rollout_id
        payload["group_id"] = task.group_id
        agent = _agent_for(task.row, self.agent)
        for attempt in range(1, options.max_attempts + 1):
            outcome = await attempt_run(self.client, agent, payload, options.timeout_s)
            if outcome.rollout is not None:
                outcome.rollout["rollout_id"], outcome.rollout["group_id"] = rollout_id, task.group_id
                return outcome.rollout
            status, error = outcome.status, outcome.error
            final = attempt == options.max_attempts or not outcome.retryable
            record = {"rollout_id": rollout_id, "group_id": task.group_id, "line": task.line, "attempt": attempt,
                      "final": final, "status": status, "error": error, "time": time.time()}
            failures.write(orjson.dumps(record) + b"\n")
            failures.flush()
            if final:
                self.failure_statuses[status] += 1
                self.failed_final += 1
                return None
            await asyncio.sleep(random.uniform(0.5, 1.0) * min(10.0, 0.5 * 2 ** (attempt - 1)))
        return None


def _agent_for(row: dict[str, Any], default: str) -> str:
    """A row may name its agent (`agent_ref`, as prepare-data stamps it); else the default agent."""
    ref = row.get("agent_ref")
    if isinstance(ref, dict) and ref.get("name"):
        return str(ref["name"])
    if isinstance(ref, str) and ref:
        return ref
    return default


def _mean(total: float, count: int) -> str:
    return f"{total / count:.3f}" if count else "-"


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="rollouts", unit="rollout", disable=not enabled,
                dynamic_ncols=True, mininterval=0.25, smoothing=0.1)
