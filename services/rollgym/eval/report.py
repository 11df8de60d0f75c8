"""An evaluation's report: read back from its output folder, as JSON, a terminal table and markdown.

The figures come from the files, not from memory, so a resumed or interrupted run reports what is on
disk, and `rollgym eval --report OUT` re-renders a finished run without a stack. Only the rollouts the
run asks for count: the first `limit` tasks of the task file, `repeats` each (a rollouts file from an
earlier, larger run contributes only those). A rollout whose last attempt failed counts under
`failed` with its status, never as a reward; one neither finished nor failed (a run cut short) under
`missing`.

An environment whose tasks come from several sources (a reasoning-gym mixture: each row names its
generator) is also broken down by source: each task's source is the first of `SOURCE_FIELDS` that the
environment's tasks carry (a string or a number; a task without it is `(no source)`), and each source
gets the same figures as its environment, under `sources` in the report and a line of its own under the
environment's in the tables. An environment with a single source gets no breakdown.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Mapping, Sequence

import orjson

from ..data.records import output_items
from ..rollouts.collector import read_tasks
from ..rollouts.metrics import k_values
from ..rollouts.sink import companion_paths
from . import stats
from .suite import Environment

MANIFEST = "eval.json"
REPORT_JSON = "report.json"
REPORT_MD = "report.md"
# Where a task row names its source, first found first: a field any task file may add, reasoning-gym's
# own entry metadata, this repository's reasoning-gym rows (the generator), gymnasium and textarena (the game).
SOURCE_FIELDS = ("source", "metadata.source", "metadata.source_dataset", "dataset", "env_id")
NO_SOURCE = "(no source)"


def rollouts_path(output: Path, environment: str, label: str) -> Path:
    return output / environment / f"{label}.jsonl"


def task_source(row: Mapping[str, Any], field: str) -> str | None:
    """The value of a dotted `field` of a task row, as text, when it is a non-empty string or a number."""
    value: Any = row
    for key in field.split("."):
        value = value.get(key) if isinstance(value, Mapping) else None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)) or value == "":
        return None
    return str(value)


def task_sources(env: Environment) -> tuple[str | None, dict[str, str]]:
    """The field that names the environment's task sources and each task's source (group id → source);
    (None, {}) when its tasks name fewer than two."""
    tasks, _ = read_tasks(env.tasks, env.limit)
    for field in SOURCE_FIELDS:
        if any(task_source(task.row, field) is not None for task in tasks):
            sources = {task.group_id: task_source(task.row, field) or NO_SOURCE for task in tasks}
            return (field, sources) if len(set(sources.values())) > 1 else (None, {})
    return None, {}


def cell(env: Environment, rollouts: Path, sources: Mapping[str, str] | None = None
         ) -> tuple[dict[str, Any], dict[str, stats.TaskResult]]:
    """One environment × model: its figures (and each source's, for `sources`: group id → source), and each
    scored task's result (for paired comparisons)."""
    tasks, _ = read_tasks(env.tasks, env.limit)
    wanted = {task.rollout_id(k): task.group_id for task in tasks for k in range(env.repeats)}
    rewards: dict[str, list[float]] = defaultdict(list)
    statuses: Counter = Counter()
    versions: Counter = Counter()
    finished: set[str] = set()
    if rollouts.is_file():
        for raw in rollouts.read_bytes().splitlines():
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue  # a torn last line: the collector repairs it on its next run
            rollout_id = str(row.get("rollout_id"))
            if rollout_id not in wanted or rollout_id in finished or row.get("reward") is None:
                continue
            finished.add(rollout_id)
            rewards[wanted[rollout_id]].append(float(row["reward"]))
            statuses[str(row.get("status", "ok"))] += 1
            versions.update(_versions(row))
    failed: dict[str, str] = {}
    failures_file, _ = companion_paths(rollouts)
    if failures_file.is_file():
        for raw in failures_file.read_bytes().splitlines():
            try:
                row = orjson.loads(raw)
            except orjson.JSONDecodeError:
                continue
            rollout_id = str(row.get("rollout_id"))
            if row.get("final") and rollout_id in wanted and rollout_id not in finished:
                failed[rollout_id] = str(row.get("status"))
    failures: dict[str, Counter] = defaultdict(Counter)  # group id → its failed rollouts' statuses
    for rollout_id, status in failed.items():
        failures[wanted[rollout_id]][status] += 1
    results = [stats.TaskResult(task.group_id, tuple(rewards.get(task.group_id, ())),
                                sum(failures[task.group_id].values())) for task in tasks]
    figures = _figures(env, results, failures)
    figures.update(status_counts=dict(sorted(statuses.items())), model_versions=sorted(versions))
    if sources:
        by_source: dict[str, list[stats.TaskResult]] = defaultdict(list)
        for result in results:
            by_source[sources.get(result.task, NO_SOURCE)].append(result)
        figures["sources"] = {name: _figures(env, by_source[name], failures) for name in sorted(by_source)}
    return figures, {result.task: result for result in results if result.n}


def _figures(env: Environment, results: Sequence[stats.TaskResult], failures: Mapping[str, Counter]
             ) -> dict[str, Any]:
    """Counts, mean reward and pass@k of some tasks' results (`failures`: group id → failed statuses)."""
    statuses: Counter = Counter()
    for result in results:
        statuses.update(failures.get(result.task, {}))
    mean = stats.mean_reward(results)
    figures: dict[str, Any] = {
        "tasks": len(results),
        "tasks_scored": sum(1 for result in results if result.n),
        "rollouts": sum(result.n for result in results),
        "failed": sum(result.failed for result in results),
        "failure_statuses": dict(sorted(statuses.items())),
        "missing": sum(env.repeats - result.n - result.failed for result in results),
        "mean_reward": mean.to_json() if mean else None,
        "pass_at_k": {},
    }
    for k in k_values(env.repeats):
        estimate = stats.pass_at_k_estimate(results, k, env.pass_threshold)
        if estimate is not None:
            figures["pass_at_k"][f"pass@{k}"] = estimate.to_json()
    return figures


def build_report(output: Path, compare: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """The report of the run recorded in OUTPUT/eval.json. `compare`: (A, B) label pairs (B - A); by
    default every model against the first one."""
    manifest = orjson.loads((output / MANIFEST).read_bytes())
    environments = [Environment.from_json(env) for env in manifest["environments"]]
    labels = [model["label"] for model in manifest["models"]]
    pairs = compare if compare else [(labels[0], label) for label in labels[1:]]
    report: dict[str, Any] = {
        "suite": manifest.get("suite"), "output": str(output), "models": manifest["models"],
        "method": {"mean_reward": stats.METHOD, "comparison": stats.PAIRED_METHOD,
                   "pass_at_k": "unbiased estimator 1 - C(n-c,k)/C(n,k) per task (Chen et al. 2021), averaged "
                                "over the tasks with at least k finished rollouts",
                   "failures": "rollouts whose last attempt failed are counted, never scored",
                   "sources": f"an environment whose tasks name two or more sources (the first of "
                              f"{', '.join(SOURCE_FIELDS)} that they carry) is broken down by source"},
        "environments": [], "comparisons": [], "wall_s": manifest.get("wall_s"),
    }
    per_task: dict[tuple[str, str], dict[str, stats.TaskResult]] = {}
    for env in environments:
        field, sources = task_sources(env)
        results = {}
        for label in labels:
            results[label], per_task[env.name, label] = cell(env, rollouts_path(output, env.name, label), sources)
        report["environments"].append({"name": env.name, "tasks_file": str(env.tasks), "repeats": env.repeats,
                                       "limit": env.limit, "pass_threshold": env.pass_threshold,
                                       "source_field": field, "results": results})
    for a, b in pairs:
        rows = {}
        for env in environments:
            comparison = stats.compare_tasks(per_task[env.name, a], per_task[env.name, b])
            rows[env.name] = comparison.to_json() if comparison else None
        report["comparisons"].append({"a": a, "b": b, "environments": rows})
    return report


# --- rendering -----------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _interval(estimate: dict[str, Any] | None) -> str:
    if not estimate:
        return "-"
    if estimate["low"] is None:
        return "(1 task)" if estimate["tasks"] < 2 else "(no spread)"
    return f"[{estimate['low']:.3f}, {estimate['high']:.3f}]"


def _rows(report: dict[str, Any], source_prefix: str) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows: each environment's models, then each source's (its name after
    `source_prefix`)."""
    ks = sorted({k for env in report["environments"] for result in env["results"].values()
                 for k in result["pass_at_k"]}, key=lambda name: int(name.split("@")[1]))
    header = ["environment", "model", "tasks", "rollouts", "failed", "mean reward", "95% CI", *ks]
    rows = []

    def row(name: str, label: str, figures: dict[str, Any]) -> list[str]:
        failed = str(figures["failed"])
        if figures["failed"]:
            failed += f" ({', '.join(f'{s} {n}' for s, n in figures['failure_statuses'].items())})"
        if figures["missing"]:
            failed += f" +{figures['missing']} missing"
        mean = figures["mean_reward"]
        return [name, label, str(figures["tasks_scored"]), str(figures["rollouts"]), failed,
                _num(mean["value"] if mean else None), _interval(mean),
                *(_num(figures["pass_at_k"][k]["value"]) if k in figures["pass_at_k"] else "-" for k in ks)]

    for env in report["environments"]:
        for index, (label, result) in enumerate(env["results"].items()):
            rows.append(row(env["name"] if index == 0 else "", label, result))
        names = sorted({name for result in env["results"].values() for name in result.get("sources", {})})
        for name in names:
            shown = [(label, result["sources"][name]) for label, result in env["results"].items()
                     if name in result.get("sources", {})]
            rows += [row(source_prefix + name if index == 0 else "", label, figures)
                     for index, (label, figures) in enumerate(shown)]
    return header, rows


def _source_note(report: dict[str, Any]) -> str | None:
    """Which task field each broken-down environment's sources come from, or None when none is."""
    fields = [f"{env['name']} by each task's `{env['source_field']}`" for env in report["environments"]
              if env.get("source_field")]
    return f"sources: {', '.join(fields)}" if fields else None


VERDICTS = {True: "beyond noise", False: "within noise"}


def _comparison_lines(report: dict[str, Any]) -> list[list[str]]:
    lines = []
    for pair in report["comparisons"]:
        for env, row in pair["environments"].items():
            if row is None:
                verdict, numbers = "no task finished by both", ["-", "-", "-"]
            else:
                verdict = VERDICTS.get(row["beyond_noise"]) or \
                    ("too few tasks to tell" if row["tasks"] < 2 else "no spread to measure")
                numbers = [f"{row['difference']:+.3f}",
                           "-" if row["low"] is None else f"[{row['low']:+.3f}, {row['high']:+.3f}]",
                           "-" if row["p_value"] is None else f"{row['p_value']:.3g}"]
            lines.append([env, f"{pair['b']} - {pair['a']}", str(row["tasks"] if row else 0), *numbers, verdict])
    return lines


COMPARISON_HEADER = ["environment", "models", "tasks", "difference", "95% CI", "p", "verdict"]


def render_table(report: dict[str, Any]) -> str:
    """Aligned plain-text tables for a terminal."""
    header, rows = _rows(report, "  ")
    parts = [f"rollgym eval{' ' + report['suite'] if report.get('suite') else ''}: {report['output']}",
             _aligned(header, rows)]
    comparisons = _comparison_lines(report)
    if comparisons:
        parts += ["", "B - A, paired over tasks:", _aligned(COMPARISON_HEADER, comparisons)]
    parts += ["", f"mean reward: {report['method']['mean_reward']}; failed rollouts are counted, not scored"]
    note = _source_note(report)
    return "\n".join(parts + [note] if note else parts)


def render_markdown(report: dict[str, Any]) -> str:
    header, rows = _rows(report, "↳ ")
    parts = [f"# Evaluation{': ' + report['suite'] if report.get('suite') else ''}", ""]
    parts += [f"- **{m['label']}**: `{m['adapter'] or m['request_model']}` (model_version `{m['model_version']}`)"
              for m in report["models"]]
    parts += ["", _markdown(header, rows), ""]
    comparisons = _comparison_lines(report)
    if comparisons:
        parts += ["## Differences (B - A, paired over tasks)", "", _markdown(COMPARISON_HEADER, comparisons), ""]
    method = report["method"]
    parts += [f"- mean reward and its 95 % CI: {method['mean_reward']}",
              f"- differences: {method['comparison']}; beyond noise when the CI leaves out 0",
              f"- pass@k: {method['pass_at_k']}", f"- {method['failures']}"]
    note = _source_note(report)
    return "\n".join(parts + ([f"- {note}"] if note else []) + [""])


def _aligned(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(row, widths)).rstrip()
                     for row in [header, *rows])


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(value or " " for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _versions(row: dict[str, Any]) -> set[str]:
    versions = set()
    response = row.get("response")
    for item in [response, *output_items(row)]:
        if isinstance(item, dict) and item.get("model_version"):
            versions.add(str(item["model_version"]))
    return versions


def write_report(output: Path, report: dict[str, Any]) -> None:
    (output / REPORT_JSON).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
    (output / REPORT_MD).write_text(render_markdown(report))


__all__ = ["MANIFEST", "NO_SOURCE", "REPORT_JSON", "REPORT_MD", "SOURCE_FIELDS", "build_report", "cell",
           "render_markdown", "render_table", "rollouts_path", "task_source", "task_sources", "write_report"]
