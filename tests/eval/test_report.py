"""The report read back from an output folder's files: what counts (the tasks and repeats asked for), failures
apart from rewards, renderings, and the report's page in `rollgym view`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from rollgym.eval.report import (
    SOURCE_FIELDS,
    build_report,
    render_markdown,
    render_table,
    task_source,
    task_sources,
    write_report,
)
from rollgym.eval.runner import write_manifest
from rollgym.eval.models import Model
from rollgym.eval.suite import Environment
from rollgym.rollouts.collector import read_tasks
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


def test_a_mixture_is_broken_down_by_source(tmp_path: Path) -> None:
    """Real reasoning-gym rows (the first seven of the bundled held-out mixture: leg_counting and
    spell_backward, named by each row's `dataset`), two repeats, rewards written by hand: each generator
    gets its own n, mean and interval under the environment's line."""
    source = Path(__file__).resolve().parents[2] / "resources_servers/reasoning_gym/data/easy_validation.jsonl"
    tasks_file = tmp_path / "mixture.jsonl"
    tasks_file.write_text("".join(source.read_text().splitlines(keepends=True)[:7]))
    tasks, _ = read_tasks(tasks_file)
    assert [task.row["dataset"] for task in tasks] == ["leg_counting", "leg_counting", "spell_backward",
                                                       "leg_counting", "leg_counting", "spell_backward",
                                                       "spell_backward"]
    env = Environment("rg", [tmp_path / "rg.yaml"], tasks_file, "rg_agent", repeats=2, limit=None, pass_threshold=1.0)
    out = tmp_path / "out"
    write_manifest(out, "mix", [env], [Model("a", "base", "base")])
    rewards = [(1.0, 1.0), (1.0, 0.0), (0.0, 0.0), (0.0, 0.0), (1.0, 1.0), (0.0, 0.0), (0.0,)]  # task 7: one failed
    rows(out / "rg" / "a.jsonl", [{"rollout_id": task.rollout_id(k), "group_id": task.group_id, "reward": reward}
                                  for task, pair in zip(tasks, rewards) for k, reward in enumerate(pair)])
    rows(out / "rg" / "a.failures.jsonl", [{"rollout_id": tasks[6].rollout_id(1), "final": True, "status": "timeout"}])
    report = build_report(out)
    (environment,) = report["environments"]
    assert environment["source_field"] == "dataset"
    result = environment["results"]["a"]
    legs, spelling = result["sources"]["leg_counting"], result["sources"]["spell_backward"]
    assert (legs["tasks"], legs["rollouts"], legs["failed"], legs["missing"]) == (4, 8, 0, 0)
    assert (spelling["tasks"], spelling["rollouts"], spelling["failed"], spelling["failure_statuses"]) == \
        (3, 5, 1, {"timeout": 1})
    assert result["rollouts"] == 13 and result["failed"] == 1  # the environment's line still holds all seven
    # leg_counting: task means 1, 0.5, 0, 1: mean 0.625; se² = var(means)/4 = 0.05729 is above the
    # rollouts' own var/N = 0.625·0.375/8 = 0.02930, so n_eff = 0.234375/0.05729 = 4.09 at t(0.975, 3)
    assert legs["mean_reward"]["value"] == 0.625 and legs["mean_reward"]["method"] == "wilson-effective-n"
    means = [1.0, 0.5, 0.0, 1.0]
    se2 = sum((m - 0.625) ** 2 for m in means) / 3 / 4
    low, high = wilson_by_hand(0.625, 0.625 * 0.375 / se2, 3.182446305284263)
    assert (legs["mean_reward"]["low"], legs["mean_reward"]["high"]) == (pytest.approx(low), pytest.approx(high))
    assert legs["pass_at_k"]["pass@1"]["value"] == pytest.approx(0.625)
    # spell_backward: 0 of 3 tasks, Wilson [0, z²/(3 + z²)]
    z = 1.959963984540054
    assert (spelling["mean_reward"]["value"], spelling["mean_reward"]["low"]) == (0.0, 0.0)
    assert spelling["mean_reward"]["high"] == pytest.approx(z * z / (3 + z * z))

    legs_interval = f"[{low:.3f}, {high:.3f}]".split()
    table = render_table(report).splitlines()
    at = next(i for i, line in enumerate(table) if line.startswith("rg "))
    assert table[at + 1].split() == ["leg_counting", "a", "4", "8", "0", "0.625", *legs_interval, "0.625", "0.750"]
    assert table[at + 1].startswith("  leg_counting ")  # under the environment's line, indented
    assert table[at + 2].split() == ["spell_backward", "a", "3", "5", "1", "(timeout", "1)", "0.000", "[0.000,",
                                     "0.561]", "0.000", "0.000"]
    assert "sources: rg by each task's `dataset`" in table
    markdown = render_markdown(report)
    assert "| ↳ leg_counting | a | 4 | 8 | 0 | 0.625 |" in markdown
    assert "- sources: rg by each task's `dataset`" in markdown


def test_one_source_or_none_gives_no_breakdown(folder: Path, tmp_path: Path) -> None:
    report = build_report(folder)  # the toy tasks name no source
    assert report["environments"][0]["source_field"] is None
    assert "sources" not in report["environments"][0]["results"]["a"] and "sources:" not in render_table(report)
    single = tmp_path / "one.jsonl"
    rows(single, [{"dataset": "leg_counting", "responses_create_params": {"input": "x"}}] * 2)
    env = Environment("one", [tmp_path / "one.yaml"], single, "agent", repeats=1, limit=None, pass_threshold=1.0)
    assert task_sources(env) == (None, {})


def test_the_source_fields_in_order() -> None:
    row = {"source": "mine", "metadata": {"source_dataset": "rg"}, "dataset": "leg_counting", "env_id": "x"}
    assert [task_source(row, field) for field in SOURCE_FIELDS] == ["mine", None, "rg", "leg_counting", "x"]
    assert task_source({"dataset": {"name": "x"}}, "dataset") is None  # not a name
    assert task_source({"dataset": ""}, "dataset") is None and task_source({"env_id": 3}, "env_id") == "3"
    assert task_source({"metadata": "text"}, "metadata.source") is None


def wilson_by_hand(p: float, n: float, k: float) -> tuple[float, float]:
    """(p + k²/2n ± k·√(p(1-p)/n + k²/4n²)) / (1 + k²/n)."""
    centre, half = p + k * k / (2 * n), k * math.sqrt(p * (1 - p) / n + k * k / (4 * n * n))
    return (centre - half) / (1 + k * k / n), (centre + half) / (1 + k * k / n)
