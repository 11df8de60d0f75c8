"""`rollgym eval` end to end on the scripted backend: two models (the base and a hot-loaded adapter, which the
scripted model makes answer "[tuned] ..."), their report side by side, --compare, resume, and every bad input
as one line with exit 2 (a model server that does not answer: exit 1 with the cause)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import pytest

from rollgym.cli import main
from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT, free_port
from tests.conftest import scripted_stack

SUITE = """\
name: tiny
repeats: 2
params: {temperature: 0.5}
environments:
  reverse_text:
    config: resources_servers/reverse_text/configs/reverse_text.yaml
    tasks: resources_servers/reverse_text/data/example.jsonl
    repeats: 4
  weather:
    config: [resources_servers/weather/configs/weather.yaml]
    tasks: resources_servers/weather/data/example.jsonl
    limit: 3
    params: {tool_choice: {type: function, name: get_weather}}
"""


def write_registry(path: Path, registry: dict[str, ServerAddress]) -> Path:
    path.write_text(json.dumps({name: address.to_json() for name, address in registry.items()}))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, Path]]:
    """(registry file, suite file, adapter folder) of a scripted stack with both environments' agents."""
    folder = tmp_path_factory.mktemp("eval")
    adapter = folder / "tuned-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    suite = folder / "tiny.yaml"
    suite.write_text(SUITE)
    with scripted_stack() as registry:
        yield write_registry(folder / "stack.json", registry), suite, adapter


def evaluate(*args: str) -> int:
    return main(["eval", "--no-progress", *args])


def test_two_models_side_by_side_with_compare_and_resume(stack, tmp_path: Path, capsys, monkeypatch) -> None:
    registry, suite, adapter = stack
    monkeypatch.chdir(tmp_path)  # relative paths of the suite resolve from the checkout
    out = tmp_path / "out"
    args = [str(suite), "--registry-file", str(registry), "--model", "base", "--model", f"tuned={adapter}",
            "--output", str(out), "--compare", "base", "tuned"]
    assert evaluate(*args, "--format", "json") == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert [m["label"] for m in report["models"]] == ["base", "tuned"]
    assert report["models"][1]["model_version"].startswith("tuned@")
    envs = {env["name"]: env for env in report["environments"]}
    reverse, weather = envs["reverse_text"]["results"], envs["weather"]["results"]
    assert reverse["base"]["rollouts"] == 20 and reverse["base"]["tasks_scored"] == 5 and reverse["base"]["failed"] == 0
    assert weather["tuned"]["rollouts"] == 6  # limit 3 × repeats 2
    assert reverse["base"]["mean_reward"]["value"] == 1.0 and reverse["base"]["pass_at_k"]["pass@4"]["value"] == 1.0
    # every task passed: Wilson's interval over the 5 tasks, [5/(5 + z²), 1], not [1, 1]
    assert reverse["base"]["mean_reward"]["low"] == pytest.approx(5 / (5 + 1.959964 ** 2))
    assert reverse["base"]["mean_reward"]["method"] == "wilson"
    assert reverse["tuned"]["mean_reward"]["method"] == "wilson-effective-n"  # partial credit
    assert reverse["tuned"]["mean_reward"]["value"] < 0.9  # "[tuned] " in front of the reversed text
    assert reverse["tuned"]["pass_at_k"]["pass@1"]["value"] == 0.0
    assert weather["base"]["mean_reward"]["value"] == weather["tuned"]["mean_reward"]["value"] == 1.0
    assert reverse["tuned"]["model_versions"] == [report["models"][1]["model_version"]]  # the adapter answered
    assert reverse["base"]["model_versions"] == ["scripted"]
    (pair,) = report["comparisons"]
    assert (pair["a"], pair["b"]) == ("base", "tuned")
    assert pair["environments"]["reverse_text"]["beyond_noise"] is True
    assert pair["environments"]["reverse_text"]["difference"] < 0 and pair["environments"]["reverse_text"]["tasks"] == 5
    assert pair["environments"]["weather"]["beyond_noise"] is False
    assert (out / "reverse_text" / "tuned.jsonl").is_file() and (out / "report.md").is_file()
    assert "loaded adapter" in captured.err

    # The adapter was unloaded again: the shared stack serves what it served before.
    models = json.loads((out / "eval.json").read_text())["models"]
    assert models[1]["adapter"] == str(adapter.resolve())

    # Again: nothing left to run; the table says which difference is beyond noise.
    assert evaluate(*args) == 0
    captured = capsys.readouterr()
    assert "resuming: 20 of 20 rollouts already" in captured.err
    table = captured.out
    assert "reverse_text  base" in table and "beyond noise" in table and "within noise" in table
    assert "reverse_text  base   5      20        0       1.000        [0.566, 1.000]" in table
    assert "Wilson score interval over tasks" in table

    # Rendering alone, the other way round, as markdown.
    assert evaluate("--report", str(out), "--compare", "tuned", "base", "--format", "markdown") == 0
    markdown = capsys.readouterr().out
    assert markdown.startswith("# Evaluation: tiny") and "| reverse_text | base |" in markdown
    assert "| reverse_text | base - tuned |" in markdown


def test_environments_named_on_the_command_line(stack, tmp_path: Path, capsys) -> None:
    registry, _, _ = stack
    code = evaluate("--env", "reverse_text", "--registry-file", str(registry), "--repeats", "1", "--limit", "2",
                    "--output", str(tmp_path / "o"), "--format", "json")
    assert code == 0
    (env,) = json.loads(capsys.readouterr().out)["environments"]
    assert env["name"] == "reverse_text" and env["results"]["base"]["rollouts"] == 2
    assert env["results"]["base"]["mean_reward"]["low"] is not None


def one_line_error(capsys) -> str:
    error = capsys.readouterr().err
    assert "Traceback" not in error and len(error.strip().splitlines()) == 1, error
    return error


@pytest.mark.parametrize("suite_text, message", [
    ("environments: {}\n", "key 'environments'"),
    (SUITE.replace("repeats: 2", "repeat: 2"), "key 'repeat': unknown option"),
    (SUITE.replace("example.jsonl\n    limit", "nope.jsonl\n    limit"),
     "key 'environments.weather.tasks': no such task file: resources_servers/weather/data/nope.jsonl"),
    (SUITE.replace("    limit: 3", "    limit: 0"), "key 'environments.weather.limit'"),
    ("- a list\n", "a suite is a mapping"),
])
def test_a_bad_suite_is_one_line_and_exit_2(tmp_path: Path, capsys, suite_text: str, message: str) -> None:
    path = tmp_path / "suite.yaml"
    path.write_text(suite_text)
    assert evaluate(str(path), "--registry-file", str(tmp_path / "unused.json")) == 2
    assert message in one_line_error(capsys)


def test_bad_names_are_one_line_and_exit_2(stack, tmp_path: Path, capsys) -> None:
    registry, suite, _ = stack
    cases = [
        (["--env", "nope"], "--env nope: no environment folder"),
        ([str(tmp_path / "missing.yaml")], "no such file, nor a bundled suite (bundled: "),
        ([str(suite), "--env", "mcq"], "--env mcq: not an environment of"),
        ([str(suite), "--model", "nope"], "--model nope: policy_model does not serve it (it serves scripted)"),
        ([str(suite), "--model", f"x={tmp_path / 'absent'}"], "--model x="),
        ([str(suite), "--compare", "base", "other"], "--compare other: not one of the models (base)"),
        ([str(suite), "--model-server", "nowhere"], "--model-server: the stack has no server named 'nowhere'"),
        ([str(suite), "--run", str(tmp_path)], "history.jsonl (not a `rollgym train` output folder)"),
        ([], "say what to evaluate"),
        (["--report", str(tmp_path)], "no eval.json"),
    ]
    for extra, message in cases:
        code = evaluate(*extra, "--registry-file", str(registry), "--output", str(tmp_path / "out"))
        error = one_line_error(capsys)
        assert code == 2 and message in error, (extra, error)
    assert not (tmp_path / "out" / "reverse_text").exists()  # nothing ran


def test_a_model_server_that_does_not_answer_is_exit_1_with_the_cause(stack, tmp_path: Path, capsys) -> None:
    real, suite, _ = stack
    registry = json.loads(real.read_text())
    registry["policy_model"] = ServerAddress(f"http://127.0.0.1:{free_port()}", "models").to_json()
    dead = tmp_path / "dead.json"
    dead.write_text(json.dumps(registry))
    assert evaluate(str(suite), "--registry-file", str(dead), "--output", str(tmp_path / "o")) == 1
    error = capsys.readouterr().err
    assert "model server policy_model at http://127.0.0.1:" in error and "cannot be reached" in error
    assert "Traceback" not in error


def test_the_bundled_smoke_suite_is_valid() -> None:
    from rollgym.eval.suite import find_suite, load_suite, suite_environments

    path = find_suite("smoke")
    assert path == REPO_ROOT / "evals" / "smoke.yaml"
    environments = suite_environments(load_suite(path), path)
    assert [env.name for env in environments] == ["reverse_text", "weather", "mcq"]


def test_failed_rollouts_are_counted_apart_never_as_zero(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with scripted_stack("--fail-rate", "0.4", max_retries=0) as registry:
        code = evaluate("--env", "reverse_text", "--registry-file", str(write_registry(tmp_path / "s.json", registry)),
                        "--repeats", "4", "--max-attempts", "1", "--output", str(tmp_path / "o"), "--format", "json")
    assert code == 0  # some failed, the others were scored
    result = json.loads(capsys.readouterr().out)["environments"][0]["results"]["base"]
    assert result["failed"] > 0 and result["rollouts"] + result["failed"] == 20 and result["missing"] == 0
    assert set(result["failure_statuses"]) == {"model_error"}
    assert result["mean_reward"]["value"] == 1.0  # every scored rollout reversed its word: no failure became a 0


def test_a_mixture_prints_a_line_per_source(stack, tmp_path: Path, capsys) -> None:
    """reverse_text's example tasks as a mixture of two sources (a `source` field on each row): four single
    words and one two-word phrase. Each source gets its line under the environment's, in the table, the
    JSON and report.md, with figures that the rollouts files bear out."""
    registry, _, adapter = stack
    example = (REPO_ROOT / "resources_servers/reverse_text/data/example.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in example]
    for row in rows:
        row["source"] = "phrase" if " " in row["text"] else "word"
    tasks = tmp_path / "mixture.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    suite = tmp_path / "mixture.yaml"
    suite.write_text(f"repeats: 2\nenvironments:\n  reverse_text:\n"
                     f"    config: resources_servers/reverse_text/configs/reverse_text.yaml\n    tasks: {tasks}\n")
    out = tmp_path / "out"
    args = [str(suite), "--registry-file", str(registry), "--model", "base", "--model", f"tuned={adapter}",
            "--output", str(out)]
    assert evaluate(*args, "--format", "json") == 0
    (env,) = json.loads(capsys.readouterr().out)["environments"]
    assert env["source_field"] == "source"
    base, tuned = env["results"]["base"]["sources"], env["results"]["tuned"]["sources"]
    assert set(base) == set(tuned) == {"phrase", "word"}
    assert (base["word"]["tasks"], base["word"]["rollouts"], base["word"]["mean_reward"]["value"]) == (4, 8, 1.0)
    assert base["word"]["mean_reward"]["low"] == pytest.approx(4 / (4 + 1.959964 ** 2))  # Wilson, 4 of 4 tasks
    assert (base["phrase"]["tasks"], base["phrase"]["mean_reward"]["low"]) == (1, None)  # one task: no interval
    by_source: dict[str, list[float]] = {"phrase": [], "word": []}
    for line in (out / "reverse_text" / "tuned.jsonl").read_text().splitlines():
        rollout = json.loads(line)  # it carries its task row's fields
        by_source["phrase" if " " in rollout["text"] else "word"].append(rollout["reward"])
    for name, rewards in by_source.items():  # two repeats of each task: the mean of the task means is theirs
        assert tuned[name]["rollouts"] == len(rewards)
        assert tuned[name]["mean_reward"]["value"] == pytest.approx(sum(rewards) / len(rewards))

    assert evaluate("--report", str(out)) == 0
    table = capsys.readouterr().out.splitlines()
    at = next(i for i, line in enumerate(table) if line.startswith("reverse_text"))
    assert [line.split()[:4] for line in table[at:at + 6]] == [
        ["reverse_text", "base", "5", "10"], ["tuned", "5", "10", "0"],
        ["phrase", "base", "1", "2"], ["tuned", "1", "2", "0"],
        ["word", "base", "4", "8"], ["tuned", "4", "8", "0"]]
    assert table[at + 2].startswith("  phrase ") and "(1 task)" in table[at + 2]
    assert "sources: reverse_text by each task's `source`" in table
    assert "| ↳ word | base | 4 | 8 | 0 | 1.000 |" in (out / "report.md").read_text()
