"""What `rollgym view PATH...` shows: the runs found under the paths, and their summaries.

A path is a rollouts file (`X.jsonl`, with its companions `X.failures.jsonl` and `X.metrics.json`
when present), a collection's output folder (every rollouts file in it), or a training output
folder (its `history.jsonl` and `reward.png`, and the rollouts files of its epochs).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from ..rollouts.metrics import k_values, pass_at_k
from ..rollouts.sink import companion_paths
from .index import Filters, RolloutIndex

HISTORY_FILE = "history.jsonl"
EVAL_MANIFEST, EVAL_REPORT = "eval.json", "report.json"  # rollgym.eval.report writes both
PLOT_FILE = "reward.png"
MAX_FILES = 500  # rollouts files taken from one folder
# history.jsonl: `rollgym train` writes each phase's seconds under `phases_s`; other names are accepted.
TIMING_GROUPS = ("phases_s", "timings", "timing", "phases", "phase_s")
TEXT_FIRST = ("stage", "model_version", "artefact")
# the mean reward under its usual names (`train.mean_reward`, `reward_mean`, `validation_reward`), not
# counts that mention rewards (`curated.dropped.below_min_reward`) or spreads (`reward_std`)
# The trainer's figures per step (docs/train-objective.md, "History"), charted apart from rewards.
TRAINER_NAME = re.compile(r"(train_)?loss|grad_norm|(mismatch_)?kl|clip_fraction|masked_fraction|tis_capped_fraction"
                          r"|importance_ratio_(mean|min|max)|entropy|logprob_gap_mean")
REWARD_NAME = re.compile(r"((train|validation|val|eval|test)_)?(mean_)?reward(_mean)?")


class ViewError(Exception):
    """A path that cannot be viewed; the message says which and why."""


@dataclass
class Run:
    """One rollouts file and what the collector wrote beside it."""

    id: str
    label: str
    rollouts: RolloutIndex
    failures: RolloutIndex
    metrics_path: Path


@dataclass
class Evaluation:
    """A `rollgym eval` output folder: its report.json (the report page), its rollouts files as runs."""

    id: str
    label: str
    report: Path
    runs: list[str] = field(default_factory=list)


@dataclass
class Training:
    """A training output folder: one line per epoch in history.jsonl, the reward plot beside it."""

    id: str
    label: str
    history: Path
    plot: Path | None
    runs: list[str] = field(default_factory=list)  # ids of the epochs' rollouts files


def is_rollouts_file(path: Path) -> bool:
    name = path.name
    return (name.endswith(".jsonl") and not name.endswith(".failures.jsonl") and name != HISTORY_FILE
            and _looks_like_rollouts(path))


def _looks_like_rollouts(path: Path) -> bool:
    """An empty file (a collection just started) or one whose first line is a rollout."""
    try:
        with open(path, "rb") as handle:
            first = handle.readline(16 * 1024 * 1024)
    except OSError:
        return False
    if not first.strip():
        return True
    try:
        row = orjson.loads(first)
    except orjson.JSONDecodeError:
        return not first.endswith(b"\n")  # a first line still being written
    # A rollout carries its request and response; training records made from rollouts (curated.jsonl,
    # exports) keep the ids and reward but not those.
    return isinstance(row, dict) and ("response" in row or "responses_create_params" in row)


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


class Catalog:
    """Every run and training folder named on the command line."""

    def __init__(self, paths: list[Path]) -> None:
        self.runs: dict[str, Run] = {}
        self.trainings: dict[str, Training] = {}
        self.evaluations: dict[str, Evaluation] = {}
        for path in paths:
            self._add(Path(path))
        if not self.runs and not self.trainings and not self.evaluations:
            raise ViewError("no rollouts files or training history found in " + ", ".join(map(str, paths)))

    def _add(self, path: Path) -> None:
        if not path.exists():
            raise ViewError(f"{path}: no such file or folder")
        if path.is_file():
            if path.name == EVAL_REPORT and (path.parent / EVAL_MANIFEST).is_file():
                self._add(path.parent)
            elif path.name == HISTORY_FILE:
                self._add_training(path.parent, [])
            elif not path.name.endswith(".jsonl"):
                raise ViewError(f"{path}: not a rollouts .jsonl file, a collection folder or a training folder")
            else:
                self._add_run(path)
            return
        files = sorted(p for p in path.rglob("*.jsonl") if is_rollouts_file(p))[:MAX_FILES]
        ids = [self._add_run(p) for p in files]
        for report in sorted(path.rglob(EVAL_REPORT)):
            if (report.parent / EVAL_MANIFEST).is_file():
                self._add_evaluation(report, [run_id for run_id, p in zip(ids, files) if report.parent in p.parents])
        if (path / HISTORY_FILE).is_file():
            self._add_training(path, ids)
        elif not files:
            raise ViewError(f"{path}: no rollouts files (*.jsonl) or {HISTORY_FILE} in this folder")

    def _add_run(self, path: Path) -> str:
        for run in self.runs.values():
            if run.rollouts.path.resolve() == path.resolve():
                return run.id
        failures, metrics = companion_paths(path)
        run_id = f"r{len(self.runs)}"
        self.runs[run_id] = Run(run_id, _label(path), RolloutIndex(path), RolloutIndex(failures), metrics)
        return run_id

    def _add_evaluation(self, report: Path, run_ids: list[str]) -> None:
        if any(found.report.resolve() == report.resolve() for found in self.evaluations.values()):
            return
        evaluation_id = f"e{len(self.evaluations)}"
        self.evaluations[evaluation_id] = Evaluation(evaluation_id, _label(report.parent), report, run_ids)

    def evaluation(self, evaluation_id: str) -> Evaluation:
        try:
            return self.evaluations[evaluation_id]
        except KeyError:
            raise ViewError(f"no evaluation '{evaluation_id}'") from None

    def _add_training(self, folder: Path, run_ids: list[str]) -> None:
        plot = folder / PLOT_FILE
        training_id = f"t{len(self.trainings)}"
        self.trainings[training_id] = Training(training_id, _label(folder), folder / HISTORY_FILE,
                                               plot if plot.is_file() else None, run_ids)

    def run(self, run_id: str) -> Run:
        try:
            return self.runs[run_id]
        except KeyError:
            raise ViewError(f"no run '{run_id}' (runs: {', '.join(self.runs) or 'none'})") from None

    def training(self, training_id: str) -> Training:
        try:
            return self.trainings[training_id]
        except KeyError:
            raise ViewError(f"no training run '{training_id}'") from None


# --- summaries ---------------------------------------------------------------------------------


def _clean(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


def summarize_run(run: Run, pass_threshold: float = 1.0) -> dict[str, Any]:
    """The run's figures from what is indexed now (so they follow a collection as it writes),
    with the collector's metrics.json beside them when it has been written."""
    count, cols = run.rollouts.snapshot()
    rewards = cols["reward"]
    scored = rewards[~np.isnan(rewards)]
    latency = np.sort(cols["latency"][~np.isnan(cols["latency"])])
    statuses = Counter({run.rollouts.statuses.values[code]: int(n)
                        for code, n in enumerate(np.bincount(cols["status"])) if n})
    _, failure_cols = run.failures.snapshot()
    failure_statuses = Counter({run.failures.statuses.values[code]: int(n)
                                for code, n in enumerate(np.bincount(failure_cols["status"])) if n})
    summary: dict[str, Any] = {
        "id": run.id, "label": run.label, "rollouts": count, "failed": int(failure_cols["status"].size),
        "groups": int(np.unique(cols["group"]).size),
        "indexed_complete": run.rollouts.complete, "bad_lines": run.rollouts.bad_count,
        "mean_reward": _clean(float(scored.mean())) if scored.size else None,
        "reward_std": _clean(float(scored.std())) if scored.size else None,
        "status_counts": dict(sorted(statuses.items())),
        "failure_status_counts": dict(sorted(failure_statuses.items())),
        "pass_at_k": pass_curve(cols["group"], rewards, pass_threshold),
        "pass_threshold": pass_threshold,
        "tokens": {"input_mean": _clean(float(cols["input_tokens"].mean())) if count else None,
                   "output_mean": _clean(float(cols["output_tokens"].mean())) if count else None},
        "latency_s": {f"p{q}": _clean(float(np.percentile(latency, q))) if latency.size else None
                      for q in (50, 95, 99)},
        "environments": sorted(v for v in run.rollouts.envs.values if v),
        "model_versions": sorted(v for v in run.rollouts.versions.values if v),
        "metrics_file": None,
    }
    if run.metrics_path.is_file():
        try:
            summary["metrics_file"] = orjson.loads(run.metrics_path.read_bytes())
        except (orjson.JSONDecodeError, OSError) as exc:
            summary["metrics_file"] = {"error": f"{run.metrics_path.name}: {exc}"}
    return summary


def pass_curve(groups: np.ndarray, rewards: np.ndarray, threshold: float) -> dict[str, float]:
    """pass@k for k = 1, 2, 4, ... up to the largest group, averaged over groups with ≥ k rollouts
    (the collector's unbiased estimator, rollgym.metrics.pass_at_k)."""
    scored = ~np.isnan(rewards)
    if not scored.any():
        return {}
    sizes = np.bincount(groups[scored])
    passes = np.bincount(groups[scored], weights=(rewards[scored] >= threshold).astype(np.float64),
                         minlength=sizes.size).astype(np.int64)
    present = sizes > 0
    pairs = Counter(zip(sizes[present].tolist(), passes[present].tolist()))
    curve = {}
    for k in k_values(int(sizes.max())):
        weighted = [(pass_at_k(n, c, k), m) for (n, c), m in pairs.items() if n >= k]
        total = sum(m for _, m in weighted)
        if total:
            curve[f"pass@{k}"] = sum(p * m for p, m in weighted) / total
    return curve


def histogram(values: np.ndarray, bins: int = 20, low: float | None = None, high: float | None = None) -> dict:
    values = values[~np.isnan(values)]
    if not values.size:
        return {"edges": [], "counts": []}
    low = float(values.min()) if low is None else low
    high = float(values.max()) if high is None else high
    if high <= low:
        high = low + 1.0
    counts, edges = np.histogram(values, bins=bins, range=(low, high))
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def run_charts(run: Run, filters: Filters | None = None) -> dict[str, Any]:
    """Reward histogram and latency distribution of a run's (filtered) rollouts."""
    count, keep = run.rollouts.mask(filters or Filters())
    _, cols = run.rollouts.snapshot()
    rewards = cols["reward"][:count][keep]
    low = min(0.0, float(np.nanmin(rewards))) if np.isfinite(rewards).any() else 0.0
    high = max(1.0, float(np.nanmax(rewards))) if np.isfinite(rewards).any() else 1.0
    return {"reward": histogram(rewards, 20, low, high),
            "latency": histogram(cols["latency"][:count][keep], 30)}


def read_history(path: Path) -> dict[str, Any]:
    """history.jsonl as series: x (epoch, else step, else the line number), each numeric field
    flattened to a dotted name (`train.mean_reward`, `phases_s.collect`), reward-like and
    timing-like and the trainer's names (loss, grad_norm, kl, clip and masked fractions) listed apart
    for the charts, and the top-level text fields per epoch."""
    rows, bad = [], []
    with open(path, "rb") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                if line.endswith(b"\n"):
                    bad.append(f"line {number}: {exc}")
                continue
            if isinstance(row, dict):
                rows.append(row)
    flat = [_flatten(row) for row in rows]
    names = sorted({name for row in flat for name in row})
    x = [row.get("epoch", row.get("step", i)) for i, row in enumerate(flat)]
    series = {name: [row.get(name) for row in flat] for name in names}
    rewards = [n for n in names if REWARD_NAME.fullmatch(n.rsplit(".", 1)[-1].lower())]
    passes = [n for n in names if "pass@" in n.lower()]
    timings = [n for n in names if n.split(".")[0] in TIMING_GROUPS or (n.endswith("_s") and n not in rewards)]
    trainer = [n for n in names if n.startswith("train.") and TRAINER_NAME.fullmatch(n.rsplit(".", 1)[-1])]
    text_names = sorted({k for row in rows for k, v in row.items() if isinstance(v, str)}, key=_text_order)
    texts = {name: [row.get(name) if isinstance(row.get(name), str) else None for row in rows] for name in text_names}
    return {"x": x, "series": series, "reward": rewards, "pass": passes, "timings": timings, "trainer": trainer,
            "texts": texts,
            "rows": len(rows), "bad_lines": bad}


def _text_order(name: str) -> tuple[int, str]:
    return (TEXT_FIRST.index(name) if name in TEXT_FIRST else len(TEXT_FIRST), name)


def _flatten(row: dict[str, Any], prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            flat[name] = float(value)
        elif isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
    return flat
