"""The report read back from an output folder's files: what counts (the tasks and repeats asked for), failures
apart from rewards, renderings, and the report's page in `rollgym view`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollgym.eval.report import build_report, render_markdown, render_table, write_report
from rollgym.eval.runner import write_manifest
from rollgym.eval.models import Model
from rollgym.eval.suite import Environment
from rollgym.testing import serve_in_thread
from rollgym.view.app import ViewServer
from rollgym.view.runs import Catalog


def rows(path: Path, items: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(item) + "\n" for item in items))


def rollout(task: str, repeat: int, reward: float, version: str = "m") -> dict[str, Any]:
    return {"rollout_id": f"{task}-r{repeat}", "group_id": task, "reward": reward, "status": "ok",
            "response": {"output": [{"type": "message", "model_version": version}]}}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks.jsonl"
    rows(tasks, [{"group_id": f"t{i}", "responses_create_params": {"input": f"task {i}"}} for i in range(1, 5)])
    env = Environment("toy", [tmp_path / "toy.yaml"], tasks, "toy_agent", repeats=2, limit=3, pass_threshold=1.0)
    out = tmp_path / "out"
    models = [Model("a", "base", "base"), Model("b", "b", "b@123", adapter="/adapters/b")]
    write_manifest(out, "toy-suite", [env], models, wall_s=1.5)
    rows(out / "toy" / "a.jsonl", [
        rollout("t1", 0, 1.0), rollout("t1", 1, 1.0), rollout("t2", 0, 0.0), rollout("t3", 0, 0.5),
        rollout("t3", 1, 0.5), rollout("t4", 0, 1.0),  # t4 is past the limit: not counted
        rollout("t1", 2, 1.0),  # a third repeat from an earlier run with more repeats: not counted
    ])
    rows(out / "toy" / "a.failures.jsonl", [
        {"rollout_id": "t2-r1", "group_id": "t2", "final": False, "status": "timeout"},
        {"rollout_id": "t2-r1", "group_id": "t2", "final": True, "status": "timeout"},
    ])
    rows(out / "toy" / "b.jsonl", [rollout(t, k, 1.0, "b@123") for t in ("t1", "t2", "t3") for k in (0, 1)])
    return out


def test_only_the_rollouts_asked_for_count_and_failures_are_not_rewards(folder: Path) -> None:
    report = build_report(folder)
    (env,) = report["environments"]
    a = env["results"]["a"]
    assert (a["rollouts"], a["failed"], a["missing"], a["tasks_scored"]) == (5, 1, 0, 3)
    assert a["failure_statuses"] == {"timeout": 1}
    # per-task means 1.0, 0.0 (its failed repeat is left out, not a 0), 0.5
    assert a["mean_reward"]["value"] == pytest.approx(0.5) and a["mean_reward"]["tasks"] == 3
    assert a["pass_at_k"]["pass@1"]["value"] == pytest.approx((1.0 + 0.0 + 0.0) / 3)
    assert a["pass_at_k"]["pass@2"]["tasks"] == 2  # t2 has one finished rollout: not enough for k=2
    assert a["model_versions"] == ["m"]
    (pair,) = report["comparisons"]  # by default every model against the first
    assert (pair["a"], pair["b"]) == ("a", "b")
    assert pair["environments"]["toy"]["difference"] == pytest.approx(0.5)
    assert pair["environments"]["toy"]["beyond_noise"] is False  # three tasks, differences 0, 1, 0.5

    table = render_table(report)
    assert "toy          a      3      5         1 (timeout 1)  0.500" in table
    assert "b - a" in table and "within noise" in table
    markdown = render_markdown(report)
    assert "- **b**: `/adapters/b` (model_version `b@123`)" in markdown


def test_a_cut_short_run_reports_missing_rollouts(folder: Path) -> None:
    (folder / "toy" / "b.jsonl").write_text(json.dumps(rollout("t1", 0, 1.0)) + "\n{\"torn")
    result = build_report(folder)["environments"][0]["results"]["b"]
    assert (result["rollouts"], result["missing"], result["mean_reward"]["low"]) == (1, 5, None)


def test_the_report_page_in_the_viewer(folder: Path) -> None:
    write_report(folder, build_report(folder))
    catalog = Catalog([folder / "report.json"])  # the report file, or its folder, or a folder above it
    assert len(catalog.evaluations) == 1 and len(catalog.runs) == 2
    with serve_in_thread(ViewServer(catalog)) as url, httpx.Client(base_url=url, timeout=30) as client:
        listing = client.get("/api/runs").json()
        assert listing["evaluations"] == [{"id": "e0", "label": str(folder)}]
        page = client.get("/api/evaluations/e0").json()
        assert page["report"]["suite"] == "toy-suite" and set(page["runs"]) == {"toy/a", "toy/b"}
        run = page["runs"]["toy/a"]
        assert client.get(f"/api/runs/{run}/rollouts").json()["total"] == 7  # the link opens that file's rollouts
        missing = client.get("/api/evaluations/e9")
        assert missing.status_code == 404 and "no evaluation 'e9'" in missing.text
        assert "api/evaluations/${id}" in client.get("/static/app.js").text  # the page that draws it


def test_tasks_that_all_scored_0_get_an_interval_not_a_point(tmp_path: Path) -> None:
    """Six tasks, two rollouts each, every reward 0: Wilson's interval over the six tasks, [0, z²/(6 + z²)],
    where Student's t over six equal values said [0.000, 0.000]; the comparison of two such models is
    no more certain."""
    tasks = tmp_path / "tasks.jsonl"
    rows(tasks, [{"group_id": f"t{i}", "responses_create_params": {"input": f"task {i}"}} for i in range(6)])
    env = Environment("hard", [tmp_path / "hard.yaml"], tasks, "hard_agent", repeats=2, limit=None, pass_threshold=1.0)
    out = tmp_path / "out"
    write_manifest(out, None, [env], [Model("a", "base", "base"), Model("b", "b", "b")])
    for label in ("a", "b"):
        rows(out / "hard" / f"{label}.jsonl", [rollout(f"t{i}", k, 0.0) for i in range(6) for k in range(2)])
    report = build_report(out)
    mean = report["environments"][0]["results"]["a"]["mean_reward"]
    assert (mean["value"], mean["low"], mean["method"]) == (0.0, 0.0, "wilson")
    assert mean["high"] == pytest.approx(1.959964 ** 2 / (6 + 1.959964 ** 2))
    assert "[0.000, 0.390]" in render_table(report) and "[0.000, 0.000]" not in render_table(report)
    difference = report["comparisons"][0]["environments"]["hard"]
    assert (difference["low"], difference["high"]) == (pytest.approx(-0.390, abs=1e-3), pytest.approx(0.390, abs=1e-3))
    assert (difference["p_value"], difference["beyond_noise"]) == (1.0, False)


def test_equal_rewards_outside_0_1_have_no_interval_and_say_why(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    rows(tasks, [{"group_id": f"t{i}", "responses_create_params": {"input": f"task {i}"}} for i in range(3)])
    env = Environment("cliff", [tmp_path / "cliff.yaml"], tasks, "agent", repeats=1, limit=None, pass_threshold=1.0)
    out = tmp_path / "out"
    write_manifest(out, None, [env], [Model("a", "base", "base"), Model("b", "b", "b")])
    rows(out / "cliff" / "a.jsonl", [rollout(f"t{i}", 0, -13.0) for i in range(3)])  # a return, not in [0, 1]
    rows(out / "cliff" / "b.jsonl", [rollout(f"t{i}", 0, -14.0) for i in range(3)])
    table = render_table(build_report(out))
    assert "-13.000      (no spread)" in table and "no spread to measure" in table
