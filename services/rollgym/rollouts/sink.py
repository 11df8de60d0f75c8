"""The one writer of a collection's output: rollouts and failures files, progress bar, metrics.

The local collector and the Ray driver both write through a `RolloutSink`: each finished rollout is
appended to `rollouts.jsonl` (in the shape `rollout_line` gives it) and flushed as it arrives (a kill loses nothing finished), every failed
attempt to `rollouts.failures.jsonl`, and at the end the summary goes to `rollouts.metrics.json`.
`scan_output` reads what an earlier run wrote, so a rerun resumes by `rollout_id`.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping

import orjson

from ..data.jsonl import iter_raw, repair_torn_tail, truncate
from .metrics import RolloutRecord, summarize


def rollout_line(rollout: dict[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """The line written for a finished rollout of task `row`, as the format specification writes one: the
    response's output items at the top as `output` (moved, not copied: `response` keeps its id, model, usage
    and version), and `metadata`, the task's fields that are not the request. The agent's other fields stay
    where they are (the task's fields echoed at the top among them, as /run answers)."""
    response = rollout.get("response")
    if type(response) is not dict or type(response.get("output")) is not list:
        return rollout
    rest = dict(response)
    line = dict(rollout)
    line["response"] = rest
    line["output"] = rest.pop("output")
    line["metadata"] = {key: value for key, value in row.items() if key != "responses_create_params"}
    return line


def companion_paths(output: Path) -> tuple[Path, Path]:
    """`rollouts.jsonl` → (`rollouts.failures.jsonl`, `rollouts.metrics.json`)."""
    stem = output.with_suffix("") if output.suffix == ".jsonl" else output
    return stem.with_name(stem.name + ".failures.jsonl"), stem.with_name(stem.name + ".metrics.json")


def scan_output(path: Path) -> tuple[dict[str, RolloutRecord], str | None]:
    """The rollouts already written (by rollout_id), repairing a torn last line from a kill.

    Returns (records, repair note). A last line without its newline, or one that does not parse,
    was cut by a crash mid-write: it is truncated away (its rollout is simply run again). An
    unreadable line before the last one is not ours to drop: ValueError.
    """
    records: dict[str, RolloutRecord] = {}
    if not path.exists():
        return records, None
    note = repair_torn_tail(path)
    bad: tuple[int, int] | None = None  # (line number, offset) of an unreadable line
    for number, offset, raw in iter_raw(path):
        if bad is not None:
            raise ValueError(f"{path}: line {bad[0]} is not a rollout; refusing to resume over it")
        if not raw.strip():
            continue
        try:
            rollout = orjson.loads(raw)
            records[str(rollout["rollout_id"])] = RolloutRecord.from_rollout(rollout)
        except (orjson.JSONDecodeError, KeyError, TypeError):
            bad = (number, offset)
    if bad is not None:  # the garbled last line is a torn write too
        truncate(path, bad[1])
        note = f"repaired an unreadable last line in {path}"
    return records, note


class RolloutSink:
    """Appends rollouts and failed attempts as they come, draws the progress bar, writes the metrics.

    `done` are the records already in `output` (from `scan_output`); `total` is every rollout the run
    covers, done ones included.
    """

    def __init__(self, output: Path, *, done: dict[str, RolloutRecord], total: int, repeats: int,
                 pass_threshold: float, progress: bool, log: Callable[[str], None]) -> None:
        self.output = output
        self.failures_path, self.metrics_path = companion_paths(output)
        self.records = dict(done)
        self.repeats = repeats
        self.pass_threshold = pass_threshold
        self.failure_statuses: Counter = Counter()
        self.failed_final = 0
        self.written = 0
        verified = [record.reward for record in self.records.values() if record.reward is not None]
        self._reward_sum, self._verified = sum(verified), len(verified)  # unverified rollouts have no reward
        output.parent.mkdir(parents=True, exist_ok=True)
        note = repair_torn_tail(self.failures_path)
        if note:
            log(note)
        self._out = output.open("ab")
        self._failures = self.failures_path.open("ab")
        self._bar = _progress_bar(total, len(self.records), progress)
        self._started = time.perf_counter()

    def has(self, rollout_id: str) -> bool:
        return rollout_id in self.records

    def rollout(self, rollout: dict[str, Any]) -> None:
        """Append one finished rollout (flushed: a kill after this loses nothing)."""
        self._out.write(orjson.dumps(rollout, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
        self._out.flush()
        record = RolloutRecord.from_rollout(rollout)
        self.records[str(rollout["rollout_id"])] = record
        if record.reward is not None:
            self._reward_sum += record.reward
            self._verified += 1
        self.written += 1
        self._advance()

    def failure(self, record: dict[str, Any], *, count: bool = True) -> None:
        """Append one failed attempt; a final one (`record["final"]`) ends its rollout unless `count` is False
        (a duplicate the caller has already counted)."""
        self._failures.write(orjson.dumps(record) + b"\n")
        self._failures.flush()
        if record.get("final") and count:
            self.failed_final += 1
            self.failure_statuses[str(record["status"])] += 1
            self._advance()

    def _advance(self) -> None:
        # The postfix first, so the redraw of update() shows the mean including this rollout.
        count = self._verified
        self._bar.set_postfix(mean_reward=f"{self._reward_sum / count:.3f}" if count else "-",
                              failed=self.failed_final, refresh=False)
        self._bar.update(1)

    def close(self, *, skipped_lines: int, **run: Any) -> dict[str, Any]:
        """Close the files and write the metrics; returns the summary (`run` adds to its "run" part)."""
        self._bar.close()
        for handle in (self._out, self._failures):
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
        elapsed = time.perf_counter() - self._started
        summary = summarize(
            self.records.values(), repeats=self.repeats, pass_threshold=self.pass_threshold,
            failed=self.failed_final, failure_statuses=self.failure_statuses,
        )
        summary["run"] = {
            "new_rollouts": self.written,
            "skipped_lines": skipped_lines,
            "wall_s": round(elapsed, 3),
            "rollouts_per_s": round(self.written / elapsed, 2) if elapsed > 0 else None,
            "output": str(self.output),
            "failures": str(self.failures_path),
            **run,
        }
        self.metrics_path.write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2) + b"\n")
        return summary


class _NoProgressBar:
    def set_postfix(self, **values: Any) -> None: ...
    def update(self, count: int) -> None: ...
    def close(self) -> None: ...


def _progress_bar(total: int, initial: int, enabled: bool) -> Any:
    if not enabled:
        return _NoProgressBar()  # not even tqdm's disabled bar: importing tqdm is a collection's start-up cost
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="rollouts", unit="rollout", dynamic_ncols=True, mininterval=0.25,
                smoothing=0.1)


__all__ = ["RolloutSink", "companion_paths", "rollout_line", "scan_output"]
