"""Collector pieces on real files: task reading, resume scanning and torn-line repair, metrics."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest

from rollgym.rollouts.collector import read_tasks
from rollgym.rollouts.sink import companion_paths, scan_output
from rollgym.rollouts.metrics import RolloutRecord, pass_at_k, percentile, summarize

ROW = {"responses_create_params": {"input": "hi"}, "city": "Paris"}


def test_read_tasks_reports_bad_lines_with_numbers_and_keeps_going(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(
        json.dumps(ROW) + "\n"
        + "{broken\n"
        + "\n"
        + "[1, 2]\n"
        + json.dumps({"prompt": "no params"}) + "\n"
        + json.dumps({"responses_create_params": {"input": "x", "max_output_tokens": 0}}) + "\n"
        + json.dumps({**ROW, "city": "Oslo"}) + "\n"
    )
    tasks, problems = read_tasks(path)
    # Only the shape is checked here; the agent validates every field (line 6 is refused there, once).
    assert [t.line for t in tasks] == [1, 6, 7]
    assert [(p.line, p.message.split(":")[0]) for p in problems] == [
        (2, "not valid JSON"), (4, "expected a JSON object, got list"), (5, "field 'responses_create_params'"),
    ]
    # Group ids are stable across reads and differ between rows.
    again, _ = read_tasks(path)
    assert [t.group_id for t in again] == [t.group_id for t in tasks]
    assert tasks[0].group_id != tasks[2].group_id and tasks[0].group_id.startswith("L000001-")
    assert tasks[0].rollout_id(3) == f"{tasks[0].group_id}-r3"
    assert len(read_tasks(path, limit=1)[0]) == 1


def test_explicit_group_id_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({**ROW, "group_id": "task-7"}) + "\n")
    assert read_tasks(path)[0][0].group_id == "task-7"


def rollout(rollout_id: str, reward: float = 1.0) -> bytes:
    return orjson.dumps({"rollout_id": rollout_id, "group_id": "g", "reward": reward, "status": "ok",
                         "metrics": {"input_tokens": 3, "output_tokens": 2, "latency_s": 0.5}}) + b"\n"


def test_scan_output_repairs_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(rollout("a") + rollout("b") + rollout("c")[:20])
    records, note = scan_output(path)
    assert sorted(records) == ["a", "b"]
    assert note and "torn last line" in note
    assert path.read_bytes() == rollout("a") + rollout("b")
    # Appending after the repair gives a valid file.
    with path.open("ab") as handle:
        handle.write(rollout("c"))
    assert sorted(scan_output(path)[0]) == ["a", "b", "c"]


def test_scan_output_refuses_a_corrupt_middle_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(rollout("a") + b"garbage\n" + rollout("b"))
    with pytest.raises(ValueError, match="line 2 is not a rollout"):
        scan_output(path)
    assert path.read_bytes() == rollout("a") + b"garbage\n" + rollout("b")  # nothing destroyed


def test_companion_paths() -> None:
    assert companion_paths(Path("runs/rollouts.jsonl")) == (Path("runs/rollouts.failures.jsonl"), Path("runs/rollouts.metrics.json"))
    assert companion_paths(Path("out.json")) == (Path("out.json.failures.jsonl"), Path("out.json.metrics.json"))


def test_pass_at_k_matches_the_unbiased_estimator() -> None:
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 2, 2) == pytest.approx(1 - 1 / 6)


def test_summary_never_averages_failures_as_zero() -> None:
    records = [RolloutRecord("g1", 1.0, "ok", 10, 5, 0.1), RolloutRecord("g1", 0.0, "ok", 10, 5, 0.3),
               RolloutRecord("g2", 1.0, "truncated", 10, 7, 0.2), RolloutRecord("g2", 1.0, "ok", 10, 3, 0.4)]
    from collections import Counter

    summary = summarize(records, repeats=2, failed=5, failure_statuses=Counter({"model_error": 5}))
    assert summary["mean_reward"] == pytest.approx(0.75)
    assert summary["failed"] == 5
    assert summary["status_counts"] == {"model_error": 5, "ok": 3, "truncated": 1}
    assert summary["pass@1"] == pytest.approx((0.5 + 1.0) / 2)
    assert summary["pass@2"] == pytest.approx(1.0)
    assert summary["tokens"]["output_total"] == 20
    assert summary["latency_s"]["p50"] == pytest.approx(0.25)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 99) == pytest.approx(4.96)
