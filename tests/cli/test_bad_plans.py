"""A newcomer's mistakes, each found by `rollgym train PLAN --check` before anything starts: a non-zero exit, a
message naming the key at fault, no traceback, and no output folder. The plan is the demo's
(scripts/train/weather.yaml) with one mistake each; nothing here starts a server, so the table runs in
seconds. A run (no --check) refuses the same mistakes before it makes its output folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from rollgym.cli import main
from rollgym.testing import REPO_ROOT, free_port

DEMO = REPO_ROOT / "scripts/train/weather.yaml"


def demo(tmp_path: Path) -> dict[str, Any]:
    data = yaml.safe_load(DEMO.read_text())
    data["output"] = str(tmp_path / "run")
    data["stack"]["configs"] = [str(REPO_ROOT / item) for item in data["stack"]["configs"]]
    data["validation"]["input"] = str(REPO_ROOT / data["validation"]["input"])
    for stage in data["stages"]:
        stage["collect"]["input"] = str(REPO_ROOT / stage["collect"]["input"])
    return data


def file_in(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def collect_params(i: int, **values: Any) -> Callable[[dict, Path], None]:
    return lambda p, t: p["stages"][i]["collect"]["params"].update(values)


def validation_params(**values: Any) -> Callable[[dict, Path], None]:
    return lambda p, t: p["validation"].update(params={**p["validation"]["params"], **values})


def replay(entry: Callable[[Path], str]) -> Callable[[dict, Path], None]:
    return lambda p, t: p["stages"][0].update(replay=[entry(t)])


def dead_phoenix(tmp_path: Path) -> str:
    return f"trace://phoenix/capital?url=http://127.0.0.1:{free_port()}"


# (what is wrong, the change to the demo plan, what the message must say: the key, and the mistake)
BAD_PLANS: list[tuple[str, Callable[[dict, Path], None], list[str]]] = [
    ("sft data for grpo", lambda p, t: p["stages"][1]["optimize"].update(data="sft"),
     ["key 'stages[1].optimize'", "data: sft: grpo trains on groups records"]),
    ("groups data for trl_sft", lambda p, t: p["stages"][0]["optimize"].update(data="groups"),
     ["key 'stages[0].optimize'", "data: groups: trl_sft trains on sft records"]),
    ("negative temperature", validation_params(temperature=-1.0),
     ["key 'validation.params'", "temperature -1.0: must be at least 0"]),
    ("negative collect temperature", collect_params(0, temperature=-0.5),
     ["key 'stages[0].collect.params'", "temperature -0.5"]),
    ("temperature a word", validation_params(temperature="hot"),
     ["key 'validation.params'", "temperature 'hot': must be a number"]),
    ("top_p 0", validation_params(top_p=0), ["key 'validation.params'", "top_p 0: must be above 0 and at most 1"]),
    ("top_p above 1", collect_params(0, top_p=1.5), ["key 'stages[0].collect.params'", "top_p 1.5"]),
    ("no output tokens", validation_params(max_output_tokens=0),
     ["key 'validation.params'", "max_output_tokens 0: must be at least 1"]),
    ("half a token", collect_params(0, max_output_tokens=2.5),
     ["key 'stages[0].collect.params'", "max_output_tokens 2.5: must be a whole number"]),
    ("top_k below -1", validation_params(top_k=-5), ["key 'validation.params'", "top_k -5"]),
    ("min_p above 1", validation_params(min_p=2), ["key 'validation.params'", "min_p 2"]),
    ("presence penalty 3", validation_params(presence_penalty=3), ["key 'validation.params'", "presence_penalty 3"]),
    ("repetition penalty 0", validation_params(repetition_penalty=0),
     ["key 'validation.params'", "repetition_penalty 0"]),
    ("min_tokens past the end", validation_params(min_tokens=100),
     ["key 'validation.params'", "min_tokens 100: more than max_output_tokens 48"]),
    ("a schedule below 0", lambda p, t: p["stages"][1]["collect"]["params"].update(
        temperature={"type": "linear", "start_temperature": -1, "end_temperature": 1}),
     ["key 'stages[1].collect.params'", "temperature.start_temperature"]),
    ("Phoenix down", replay(dead_phoenix), ["key 'stages[0].replay[0]'", "Phoenix is not reachable"]),
    ("no such spans file", replay(lambda t: f"trace://local/{t}/nowhere.jsonl"),
     ["key 'stages[0].replay[0]'", "no such file"]),
    ("an empty spans file", replay(lambda t: f"trace://local/{file_in(t, 'spans.jsonl', '')}"),
     ["key 'stages[0].replay[0]'", "holds no traces"]),
    ("no such dataset", replay(lambda t: "dataset://hf/rollgym-no-such-dataset"),
     ["key 'stages[0].replay[0]'", "dataset://hf/rollgym-no-such-dataset"]),
    ("an unknown store", replay(lambda t: "trace://nowhere/x"), ["key 'stages[0].replay[0]'", "not a source"]),
    ("an unknown source option", replay(lambda t: f"trace://local/{file_in(t, 's.jsonl', '')}?scor=x"),
     ["key 'stages[0].replay[0]'", "unknown option scor"]),
    ("no such rollouts file", replay(lambda t: str(t / "old.jsonl")),
     ["key 'stages[0].replay[0]'", "no such rollouts file"]),
    ("an empty rollouts file", replay(lambda t: file_in(t, "old.jsonl", "\n")),
     ["key 'stages[0].replay[0]'", "holds no rollouts"]),
    ("an empty tasks file", lambda p, t: p["stages"][0]["collect"].update(input=file_in(t, "tasks.jsonl", "")),
     ["key 'stages[0].collect.input'", "holds no tasks"]),
    ("a tasks file that is not JSONL", lambda p, t: p["validation"].update(input=file_in(t, "v.jsonl", "city: Paris\n")),
     ["key 'validation.input'", "line 1 is not JSON"]),
    ("tasks that are lists", lambda p, t: p["stages"][1]["collect"].update(input=file_in(t, "l.jsonl", "[1, 2]\n")),
     ["key 'stages[1].collect.input'", "line 1 is a list, not a task row"]),
    ("no such validation file", lambda p, t: p["validation"].update(input=str(t / "missing.jsonl")),
     ["key 'validation.input'", "no such tasks file"]),
    ("no such GGUF", lambda p, t: p.update(base_model=str(t / "model.gguf")), ["key 'base_model'", "no such GGUF"]),
    ("an unknown trainer", lambda p, t: p["stages"][0]["optimize"].update(trainer="sft"),
     ["key 'stages[0].optimize'", "unknown trainer 'sft'"]),
    ("a misspelt key", lambda p, t: p.update(epochz=3), ["key 'epochz'", "unknown option"]),
    ("no epochs", lambda p, t: p["stages"][0].update(epochs=0), ["key 'stages[0].epochs'", "greater than or equal"]),
    ("no concurrency", lambda p, t: p["stack"].update(concurrency=0), ["key 'stack.concurrency'"]),
    ("no such stack config", lambda p, t: p["stack"].update(configs=[str(t / "env.yaml")]),
     ["key 'stack'", "config file not found"]),
    ("a misspelt trainer argument", lambda p, t: p["stages"][1]["optimize"]["args"].update(clip_hihg=0.3),
     ["key 'stages[1].optimize'", "args.clip_hihg"]),
    ("a guard without validation", lambda p, t: p.pop("validation"), ["a guard needs a validation section"]),
    ("output is a file", lambda p, t: p.update(output=file_in(t, "out", "x")), ["key 'output'", "is a file"]),
    ("async with stages", lambda p, t: p.update(mode="async"), ["mode: async needs orchestrator and optimize"]),
]


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(("change", "expected"), [case[1:] for case in BAD_PLANS], ids=[case[0] for case in BAD_PLANS])
def test_a_bad_plan_is_refused_by_key_before_anything_starts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             change: Callable[[dict, Path], None],
                                                             expected: list[str]) -> None:
    data = demo(tmp_path)
    change(data, tmp_path)
    output = Path(data.get("output", ""))
    code = main(["train", str(write(tmp_path, data)), "--check"])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code != 0, text
    assert "Traceback" not in text
    for words in expected:
        assert words in text, (words, text)
    lines = captured.err.splitlines()
    assert lines[0].endswith(f"{len(lines) - 1} problem{'s' if len(lines) != 2 else ''}; nothing started"), text
    assert output.is_file() or not output.exists()  # nothing made


def test_the_table_is_large_enough() -> None:
    assert len(BAD_PLANS) >= 30


def test_one_yaml_error_is_one_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.yaml"
    plan.write_text("base_model: bundled\nstages: [\n  - name: x\n")
    code = main(["train", str(plan), "--check"])
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines()[0] == f"{plan}: 1 problem; nothing started", err
    assert "not valid YAML" in err and "(line 3, column 3)" in err and len(err.splitlines()) == 2


def test_check_reports_what_each_source_and_file_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = demo(tmp_path)
    data["stages"][0]["replay"] = [file_in(tmp_path, "old.jsonl", '{"rollout_id": "a"}\n{"rollout_id": "b"}\n')]
    code = main(["train", str(write(tmp_path, data)), "--check"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert f"  stages[0].replay[0]: {tmp_path / 'old.jsonl'}: 2 rollouts" in out
    limit = data["stages"][0]["collect"]["limit"]
    assert "  stages[0].collect.input: " in out and f"tasks (the first {limit} used)" in out


def test_a_fixed_port_in_use_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        data = demo(tmp_path)
        data["stack"]["overrides"].append(f"weather.port={port}")
        code = main(["train", str(write(tmp_path, data)), "--check"])
    err = capsys.readouterr().err
    assert code == 2 and "key 'stack.configs': server 'weather'" in err and f"127.0.0.1:{port}" in err, err


def test_a_run_with_a_dead_source_names_the_cause_first_and_makes_no_folder(tmp_path: Path) -> None:
    """Through the real entry point in a child process, without --check: the same refusal, before the stack
    starts or the output folder is made, the cause on the first line."""
    data = demo(tmp_path)
    data["stages"][0]["replay"] = [dead_phoenix(tmp_path)]
    plan = write(tmp_path, data)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT / "services"), str(REPO_ROOT),
                                                                       os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "rollgym.cli", "train", str(plan), "--no-progress"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 2, result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"rollgym: error: {plan}: key 'stages[0].replay[0]': trace://phoenix/capital") \
        and "Phoenix is not reachable" in first, result.stderr
    assert "Traceback" not in result.stderr and "stack ready" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_a_new_run_whose_stack_does_not_start_leaves_no_folder(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The one case here that starts a process: a server that fails at startup (a model file that is not
    there, found only when it loads). The run stops with that cause and takes back the folder it made."""
    folder = tmp_path / "resources_servers" / "broken"
    folder.mkdir(parents=True)
    (folder / "app.py").write_text("from rollgym import ResourcesServer\n\n\nclass BrokenServer(ResourcesServer):\n"
                                   "    async def startup(self) -> None:\n"
                                   "        raise FileNotFoundError('model_path /models/missing.gguf: no such file')\n")
    config = folder / "broken.yaml"
    config.write_text("broken:\n  resources_servers:\n    broken:\n      entrypoint: app.py\n")
    tasks = file_in(tmp_path, "tasks.jsonl", '{"responses_create_params": {"input": "hi"}}\n')
    data = {"output": str(tmp_path / "run"), "stack": {"configs": [str(config)]},
            "stages": [{"name": "sft", "collect": {"input": tasks, "repeats": 1},
                        "optimize": {"trainer": "tests.train.toy_trainers:CountingTrainer", "data": "sft"},
                        "apply": "none"}]}
    code = main(["train", str(write(tmp_path, data)), "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0 and "server 'broken' exited with code 2 before it was ready" in err, err
    assert not (tmp_path / "run").exists()
    (tmp_path / "run").mkdir()  # a folder that was there already stays, as it was
    (tmp_path / "run" / "notes.txt").write_text("mine")
    assert main(["train", str(write(tmp_path, data)), "--no-progress"]) != 0
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["notes.txt"]


RELAY = REPO_ROOT / "scripts/train/relay-policies.yaml"


def relay(tmp_path: Path) -> dict[str, Any]:
    """The two-policy example plan (scripts/train/relay-policies.yaml), its paths made absolute."""
    data = yaml.safe_load(RELAY.read_text())
    data["output"] = str(tmp_path / "run")
    data["stack"]["configs"] = [str(REPO_ROOT / item) for item in data["stack"]["configs"]]
    data["validation"]["input"] = str(REPO_ROOT / data["validation"]["input"])
    data["stages"][0]["collect"]["input"] = str(REPO_ROOT / data["stages"][0]["collect"]["input"])
    return data


def policies(*entries: dict[str, Any]) -> Callable[[dict, Path], None]:
    return lambda p, t: p.update(policies=list(entries))


# Plans with several policies (docs/train-policies.md), each with one mistake.
BAD_POLICY_PLANS: list[tuple[str, Callable[[dict, Path], None], list[str]]] = [
    ("a call no policy claims", policies({"name": "caller"}),
     ["key 'policies'", "agent 'relay_agent' (models) asks for model 'answerer', which no policy claims"]),
    ("a policy nothing calls", policies({"name": "caller"}, {"name": "answerer"}, {"name": "critic"}),
     ["key 'policies[2]'", "nothing calls policy 'critic'"]),
    ("a name claimed twice", policies({"name": "caller"}, {"name": "answerer", "models": ["caller"]}),
     ["model 'caller' is claimed by policies 'caller' and 'answerer'"]),
    ("two defaults", policies({"name": "caller", "default": True}, {"name": "answerer", "default": True}),
     ["one default policy at most"]),
    ("a policy name that is no folder name", policies({"name": "caller"}, {"name": "answerer"}, {"name": "a/b"}),
     ["policy name 'a/b'"]),
    ("a misspelt policy trainer argument", policies({"name": "caller", "args": {"learning_rat": 1}}, {"name": "answerer"}),
     ["policies[0].args.learning_rat"]),
    ("policies served merged", lambda p, t: p["stages"][0].update(apply="merged"), ["stages apply: lora (or none)"]),
    ("policies in async mode", lambda p, t: p.update(mode="async"), ["several policies run in mode: epochs"]),
    ("an unknown credit", lambda p, t: p.update(credit="shared"), ["key 'credit'"]),
    ("policies with a curriculum of levels", lambda p, t: p["stages"][0]["collect"].update(
        levels=[p["stages"][0]["collect"].pop("input")]), ["stages[0].collect.levels: not with several policies"]),
    ("policies on a model server that does not route them", lambda p, t: p["stack"]["configs"].append(
        str(REPO_ROOT / "models/chat_completions/configs/chat_completions.yaml")), ["does not serve policies by name"]),
    ("policies with pruned checkpoints", lambda p, t: p.update(checkpoints={"keep_last": 1}),
     ["checkpoints: a run with several policies keeps every step's weights"]),
]


@pytest.mark.parametrize(("change", "expected"), [case[1:] for case in BAD_POLICY_PLANS],
                         ids=[case[0] for case in BAD_POLICY_PLANS])
def test_a_bad_policies_plan_is_refused_by_key(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               change: Callable[[dict, Path], None], expected: list[str]) -> None:
    data = relay(tmp_path)
    change(data, tmp_path)
    code = main(["train", str(write(tmp_path, data)), "--check"])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert code == 2 and "Traceback" not in text, text
    for words in expected:
        assert words in text, (words, text)
    assert not (tmp_path / "run").exists()


def test_the_policies_example_plan_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", str(write(tmp_path, relay(tmp_path))), "--check"]) == 0, capsys.readouterr()
