"""What `rollgym train` checks before anything starts, beyond the plan's keys and files (plan.py): every
source a stage reads is reachable and holds something to train on, every tasks and rollouts file holds rows,
and every port a stack config fixes is free. `--check` lists each problem with its key, and what each
source and file holds; a run that has any of them stops before its output folder is made or a server
starts, with the cause as its first line.

    stages[0].replay[0]: trace://phoenix/capital: 40 traces, 31 kept by its filters
    stages[0].collect.input: 16 tasks
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from .plan import Plan


@dataclass
class Preflight:
    """(key, what is wrong) for each problem; (key, what it holds) for each source and file that is fine."""

    problems: list[tuple[str, str]] = field(default_factory=list)
    counts: list[tuple[str, str]] = field(default_factory=list)


def preflight(plan: Plan) -> Preflight:
    """Read every source and data file the plan names and try every fixed port; nothing is written."""
    found = Preflight()
    for key, path, limit in _task_files(plan):
        _count_rows(found, key, path, "task", limit)
    for i, stage in enumerate(plan.stages):
        for j, entry in enumerate(stage.replay):
            key = f"stages[{i}].replay[{j}]"
            if "://" in entry:
                _read_source(found, key, entry, stage.optimize.data or "sft", plan.base_model)
            elif Path(entry).is_file():  # a missing one is plan.py's file_problems'
                _count_rows(found, key, entry, "rollout", None)
    found.problems += _port_problems(plan)
    return found


def _task_files(plan: Plan) -> list[tuple[str, str, int | None]]:
    files = [(f"stages[{i}].collect.{f'levels[{j}]' if stage.collect.levels else 'input'}", file, stage.collect.limit)
             for i, stage in enumerate(plan.stages) if stage.collect is not None
             for j, file in enumerate(stage.collect.files)]
    if plan.validation is not None and plan.validation.input is not None:
        files.append(("validation.input", plan.validation.input, plan.validation.limit))
    if plan.orchestrator is not None:
        files += [(f"orchestrator.envs[{i}].input", env.input, env.limit) for i, env in enumerate(plan.orchestrator.envs)]
    return [(key, file, limit) for key, file, limit in files if Path(file).is_file()]


def _count_rows(found: Preflight, key: str, path: str, kind: str, limit: int | None) -> None:
    """A JSONL file of task (or rollout) rows: each line a JSON object, at least one."""
    rows = 0
    try:
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    row = orjson.loads(line)
                except orjson.JSONDecodeError as exc:
                    found.problems.append((key, f"{path} line {number} is not JSON ({exc})"))
                    return
                if not isinstance(row, dict):
                    found.problems.append((key, f"{path} line {number} is a {type(row).__name__}, not a {kind} "
                                                "row (a JSON object)"))
                    return
                rows += 1
    except OSError as exc:
        found.problems.append((key, f"cannot read {path}: {exc.strerror or exc}"))
        return
    if rows == 0:
        found.problems.append((key, f"{path} holds no {kind}s"))
    else:
        used = f" (the first {limit} used)" if limit is not None and limit < rows else ""
        found.counts.append((key, f"{path}: {rows} {kind}{'s' if rows != 1 else ''}{used}"))


def _read_source(found: Preflight, key: str, entry: str, kind: str, base_model: str) -> None:
    """A trace:// or dataset:// source read whole: reachable, and something left after its filters; for a GRPO
    stage (`groups`), read as the stage will read it, so that episodes without served tokens are refused now."""
    from ...traces.sources import SourceError, filters_of, load, parse, read_source
    from ...traces.transforms import select

    try:
        if kind == "groups":
            replay = read_source(entry, kind, base_model)
            if replay.rows:
                found.counts.append((key, f"{entry}: {len(replay.rows)} episodes with served tokens kept by its filters"))
            else:
                notes = "".join(f"; {note}" for note in replay.notes)
                found.problems.append((key, f"{entry}: nothing to train on: no episode kept by its filters{notes}"))
            return
        source = parse(entry)
        filters = filters_of(source)
        loaded = load(source)
        traces = loaded.traces
    except (SourceError, ValueError) as exc:
        found.problems.append((key, str(exc)))
        return
    if not traces:
        notes = "".join(f"; {note}" for note in loaded.notes)
        found.problems.append((key, f"{entry}: holds no traces{notes}"))
        return
    kept = select(traces, filters)
    dropped = ", ".join(f"{reason} {n}" for reason, n in sorted(filters.dropped.items()) if n)
    counts = f"{len(traces)} traces, {len(kept)} kept by its filters" + (f" (dropped: {dropped})" if dropped else "")
    if not kept:
        notes = "".join(f"; {note}" for note in loaded.notes)
        found.problems.append((key, f"{entry}: nothing to train on: {counts}{notes}"))
    else:
        found.counts.append((key, f"{entry}: {counts}"))


def _port_problems(plan: Plan) -> list[tuple[str, str]]:
    """A server whose config fixes its port, with that port already taken: the stack would fail to start."""
    if not plan.stack.configs:
        return []
    from ...config import ConfigError, load_stack

    try:
        stack = load_stack(plan.stack.configs, plan.stack.resolved_overrides(plan.seed))
    except (ConfigError, ValueError):  # reported under stack by plan.py
        return []
    problems = []
    for name, spec in stack.servers.items():
        port = _port_of(spec.options)
        if not port:
            continue
        host = str(spec.options.get("host", "127.0.0.1"))
        for index in range(spec.replicas):
            if reason := _taken(host, port + index):
                problems.append(("stack.configs", f"server '{name}' ({spec.source}) listens on {host}:{port + index}, "
                                                  f"which {reason}; leave its port out (a free one is picked) or "
                                                  "free it"))
    return problems


def _port_of(options: dict[str, Any]) -> int:
    try:
        return int(options.get("port") or 0)
    except (TypeError, ValueError):
        return 0


def _taken(host: str, port: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the launcher binds it
        try:
            sock.bind((host, port))
        except OSError as exc:
            return f"cannot be bound ({exc.strerror or exc})"
    return None


__all__ = ["Preflight", "preflight"]
