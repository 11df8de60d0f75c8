"""A verifiers Env's tasks as rollgym task rows, for the proxy agent's `verifiers` runner.

    python -m agents.proxy_agent.verifiers_export --env '{"taskset": {"id": "gsm8k"}}' \\
        --limit 100 --output data/gsm8k.jsonl [--python-path DIR]

Each row carries the task's prompt as `responses_create_params.input` (what rollgym shows and
groups by) and the verifiers task itself under `verifiers`: `data` (the task's wire data, from
which the runner rebuilds the task), `key` (verifiers' stable task identity) and `taskset`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from typing import Any

from .verifiers_runner import TASK_FIELD, load_taskset


def export_rows(env: dict[str, Any], *, limit: int | None = None, skip: int = 0,
                python_path: list[str] = ()) -> list[dict[str, Any]]:
    """The first `limit` tasks (after `skip`) of the Env's taskset as rollgym rows; ValueError
    naming what is wrong. An infinite taskset needs a limit."""
    taskset = load_taskset(env, python_path)
    if limit is None and not taskset.bounded:
        raise ValueError(f"taskset {taskset.config.id!r} is infinite: give --limit")
    tasks = itertools.islice(taskset, skip, None if limit is None else skip + limit)
    return [row_of(task, taskset.config.id) for task in tasks]


def row_of(task: Any, taskset_id: str) -> dict[str, Any]:
    data = task.data
    messages: list[dict[str, Any]] = []
    if data.system_prompt:
        messages.append({"role": "system", "content": data.system_prompt})
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [{"role": m.role, "content": m.content if isinstance(m.content, str) else data.prompt_text}
                     for m in data.prompt if m.role in ("system", "user", "assistant")]
    return {"responses_create_params": {"input": messages or [{"role": "user", "content": ""}]},
            TASK_FIELD: {"taskset": taskset_id, "key": task.key, "data": data.model_dump(mode="json", exclude_none=True)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agents.proxy_agent.verifiers_export", description=__doc__.split("\n")[0])
    parser.add_argument("--env", required=True, help="the verifiers EnvConfig as JSON, e.g. '{\"taskset\": {\"id\": \"gsm8k\"}}'")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--skip", type=int, default=0)
    parser.add_argument("--python-path", action="append", default=[], help="a folder holding taskset modules")
    parser.add_argument("--output", default="-", help="a JSONL file; - for stdout")
    args = parser.parse_args(argv)
    try:
        env = json.loads(args.env)
        if not isinstance(env, dict):
            raise ValueError("--env: expected a JSON object")
        rows = export_rows(env, limit=args.limit, skip=args.skip, python_path=args.python_path)
    except json.JSONDecodeError as exc:
        print(f"--env: not JSON: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    text = "".join(json.dumps(row) + "\n" for row in rows)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as handle:
            handle.write(text)
        print(f"wrote {len(rows)} rows to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
