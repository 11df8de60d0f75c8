"""Running an evaluation: every environment × model through the rollout collector, into one output folder.

    OUTPUT/eval.json                 the environments and models of the run (what the report reads)
    OUTPUT/ENV/LABEL.jsonl           the rollouts of one environment × model (+ .failures.jsonl, .metrics.json)
    OUTPUT/report.json, report.md    the report (rollgym.eval.report)

Each cell is one ordinary collection (rollgym.rollouts.collector), so it resumes by rollout_id like
`rollgym collect-rollouts`: running the same command again runs only what is missing. Every request
names its model (`responses_create_params.model`), which is how a model server picks an adapter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import orjson

from ..client import ServerClient
from ..data.jsonl import write_atomic
from ..rollouts.collector import CollectOptions, Collector
from .models import Model
from .report import MANIFEST, rollouts_path
from .suite import Environment, SuiteError


@dataclass
class RunOptions:
    concurrency: int = 4
    timeout_s: float = 600.0
    max_attempts: int = 2
    progress: bool = True


def check_manifest(output: Path, models: list[Model]) -> None:
    """Refuse to add rollouts of other weights to a label's files: a resumed run must evaluate what the
    earlier one did under that label."""
    path = output / MANIFEST
    if not path.is_file():
        return
    try:
        earlier = {model["label"]: model for model in orjson.loads(path.read_bytes()).get("models", [])}
    except (orjson.JSONDecodeError, AttributeError, TypeError, KeyError):
        raise SuiteError(f"{path}: not an evaluation manifest; use another --output") from None
    for model in models:
        before = earlier.get(model.label)
        if before and before.get("model_version") and model.model_version and \
                before["model_version"] != model.model_version:
            raise SuiteError(f"--model {model.label}: {output} holds rollouts of {before['model_version']} under "
                             f"that label, now it is {model.model_version}; use another label or --output")


def write_manifest(output: Path, suite: str | None, environments: list[Environment], models: list[Model],
                   **extra: Any) -> None:
    output.mkdir(parents=True, exist_ok=True)
    data = {"suite": suite, "environments": [env.to_json() for env in environments],
            "models": [model.to_json() for model in models], **extra}
    write_atomic(output / MANIFEST, orjson.dumps(data, option=orjson.OPT_INDENT_2) + b"\n")


async def collect_all(registry: Mapping[str, Any], environments: list[Environment], models: list[Model],
                      output: Path, options: RunOptions, log: Callable[[str], None]) -> dict[tuple[str, str], dict]:
    """Collect every environment × model (environments outer, so a model server's prompt cache serves one
    environment's prompts in a row); returns the collector's summary of each."""
    summaries = {}
    client = ServerClient(registry, timeout_s=options.timeout_s, max_retries=2)
    try:
        for env in environments:
            for model in models:
                started = time.perf_counter()
                collect = CollectOptions(
                    input=env.tasks, output=rollouts_path(output, env.name, model.label), repeats=env.repeats,
                    concurrency=options.concurrency, limit=env.limit,
                    params={**env.params, "model": model.request_model}, max_attempts=options.max_attempts,
                    timeout_s=options.timeout_s, pass_threshold=env.pass_threshold, progress=options.progress,
                    force_agent=True,  # rows written for another stack still go to this environment's agent
                )
                summary = await Collector(client, env.agent, collect, log=log).run()
                summaries[env.name, model.label] = summary
                log(f"{env.name} × {model.label}: {summary['rollouts']} rollouts, {summary['failed']} failed, "
                    f"{time.perf_counter() - started:.1f} s")
    finally:
        await client.close()
    return summaries


__all__ = ["RunOptions", "check_manifest", "collect_all", "write_manifest"]
