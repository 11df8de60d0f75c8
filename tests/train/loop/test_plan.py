"""The plan YAML: a valid plan loads; every mistake is reported with the file and the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollgym.train.loop.plan import PlanError, load_plan
from rollgym.testing import REPO_ROOT

DEMO = REPO_ROOT / "scripts/train/weather.yaml"


def write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def demo() -> dict:
    return yaml.safe_load(DEMO.read_text())


def test_the_demo_plan_is_valid() -> None:
    plan = load_plan(DEMO)
    assert [stage.name for stage in plan.stages] == ["rs-sft", "grpo"]
    assert plan.stages[0].optimize.data == "sft" and plan.stages[1].optimize.data == "groups"
    assert [epoch for epoch, _ in plan.epochs()] == [1, 2]
    assert plan.validation is not None and plan.validation.every == 1


def test_overrides_replace_top_level_keys(tmp_path: Path) -> None:
    plan = load_plan(DEMO, {"output": str(tmp_path / "x"), "seed": 3})
    assert plan.output == str(tmp_path / "x") and plan.seed == 3


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["stages"][1]["optimize"].update(trainer="trl_ppo"), r"key 'stages\[1\]\.optimize': unknown trainer 'trl_ppo'"),
    (lambda p: p["stages"][0]["collect"].update(repeats=0), r"key 'stages\[0\]\.collect\.repeats': Input should be greater"),
    (lambda p: p["stages"][0]["curate"].update(min_rewad=1), r"key 'stages\[0\]\.curate\.min_rewad': unknown option"),
    (lambda p: p["stages"][0]["curate"].update(curriculum={"initial_percentile": 2}),
     r"key 'stages\[0\]\.curate\.curriculum\.initial_percentile'"),
    (lambda p: p["stages"][0].update(apply="restart"), r"key 'stages\[0\]\.apply': Input should be 'lora', 'merged', 'weights', 'memory' or 'none'"),
    (lambda p: p.pop("output"), r"key 'output': Field required"),
    (lambda p: p["stack"].update(registry_file="stack.json"), r"key 'stack': give either configs .* or registry_file"),
    (lambda p: p.update(validation=None), r"a guard needs a validation section"),
    (lambda p: p["stages"][1].update(name="rs-sft"), r"stage names must be distinct"),
    (lambda p: p["stages"][0]["optimize"].update(trainer="mypkg.trainer:Remote"), r"say what a custom trainer trains on"),
    (lambda p: p["stages"][0]["optimize"].update(trainer="no_such_module:Trainer", data="sft"),
     r"key 'stages\[0\]\.optimize': trainer: cannot import 'no_such_module:Trainer': No module named"),
    (lambda p: p["stages"][1]["collect"].update(input="no/such/tasks.jsonl"),
     r"key 'stages\[1\]\.collect\.input': no such tasks file: no/such/tasks\.jsonl"),
    (lambda p: p["validation"].update(input="resources_servers"),
     r"key 'validation\.input': resources_servers is a folder, not a tasks JSONL file"),
    (lambda p: p["stages"][1].update(apply="lora"), r"stages mix apply modes \['lora', 'merged'\]"),
    (lambda p: p.update(base_model="Qwen/Qwen3-0.6B"), r"base_model must be 'bundled' or a \*\.gguf file"),
    (lambda p: p["stages"][1]["optimize"]["args"].update(temperature=0.7),
     r"stages\[1\]\.optimize\.args\.temperature 0\.7 disagrees with stages\[1\]\.collect\.params\.temperature 1\.0"),
    (lambda p: p["stages"][1]["collect"]["params"].update(top_p=0.9),
     r"stages\[1\]\.collect\.params: top_p/top_k truncate the sampling distribution, which (trl_)?grpo cannot rebuild"),
    (lambda p: p["stages"][1]["optimize"]["args"].update(loss={"clip_hihg": 0.3}),
     r"key 'stages\[1\]\.optimize': args\.loss\.clip_hihg: Extra inputs are not permitted"),
    (lambda p: p["stages"][1]["optimize"]["args"].update(loss={"aggregation": "constant"}),
     r"args\.loss: Value error, aggregation: constant needs max_tokens"),
    (lambda p: p["stages"][1]["optimize"]["args"].update(nnodes=2),
     r"key 'stages\[1\]\.optimize': args\.rdzv_endpoint: Value error, required when nnodes > 1"),
    (lambda p: p["stages"][1]["optimize"]["args"].update(nnodes=2, rdzv_endpoint="node0"),
     r"args\.rdzv_endpoint: Value error, 'node0' is not HOST:PORT"),
    (lambda p: p["stages"][1]["optimize"]["args"].update(nnodes=2, node_rank=2, rdzv_endpoint="node0:29500"),
     r"args\.node_rank: Value error, 2 is not a node of nnodes 2"),
    (lambda p: p.update(base_model="no/such/model.gguf"), r"key 'base_model': no such GGUF file: no/such/model\.gguf"),
    (lambda p: p["stack"].update(configs=["no/such/config.yaml"]), r"key 'stack': config file not found"),
    (lambda p: p["stack"].update(agent="weathr"), r"key 'stack\.agent': the stack has no server named 'weathr'"),
])
def test_mistakes_name_the_key(tmp_path: Path, change, message: str) -> None:
    data = demo()
    change(data)
    with pytest.raises(PlanError, match=message) as caught:
        load_plan(write(tmp_path, data))
    assert str(tmp_path / "plan.yaml") in str(caught.value)


def test_unreadable_plans(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no such plan file"):
        load_plan(tmp_path / "missing.yaml")
    with pytest.raises(PlanError, match="is a folder, not a plan file"):
        load_plan(tmp_path)
    with pytest.raises(PlanError, match="is empty; a plan is a mapping"):
        load_plan(write(tmp_path, ""))
    with pytest.raises(PlanError, match="not valid YAML"):
        load_plan(write(tmp_path, "stages: [\n"))
    with pytest.raises(PlanError, match="a plan is a mapping"):
        load_plan(write(tmp_path, "- 1\n- 2\n"))


def test_cli_reports_plan_errors_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from rollgym.cli import main

    data = demo()
    data["stages"][0]["collect"]["repeats"] = "four"
    assert main(["train", str(write(tmp_path, data))]) == 2
    err = capsys.readouterr().err
    assert "key 'stages[0].collect.repeats'" in err and "Traceback" not in err
    assert main(["train", str(DEMO), "seed"]) == 2
    assert "must look like KEY=VALUE" in capsys.readouterr().err


def running_stack_plan(tmp_path: Path) -> dict:
    """A plan on a running stack (registry_file), so that nothing starts while its mistakes are checked."""
    (tmp_path / "stack.json").write_text('{"policy_model": "http://127.0.0.1:9", "agent": "http://127.0.0.1:9"}')
    (tmp_path / "tasks.jsonl").write_text('{"responses_create_params": {"input": "hi"}}\n')
    return {"output": str(tmp_path / "run"), "stack": {"registry_file": str(tmp_path / "stack.json")},
            "stages": [{"name": "s", "collect": {"input": str(tmp_path / "tasks.jsonl")},
                        "optimize": {"trainer": "trl_sft"}, "apply": "lora"}]}


def test_files_are_checked_before_the_output_is_claimed(tmp_path: Path) -> None:
    data = running_stack_plan(tmp_path)
    assert load_plan(write(tmp_path, data)).stack.registry_file == str(tmp_path / "stack.json")
    (tmp_path / "a-file").write_text("x")
    cases = [
        ({"output": str(tmp_path / "a-file")}, r"key 'output': .*a-file is a file; a run's output is a folder"),
        ({"stack": {"registry_file": str(tmp_path / "none.json")}}, r"key 'stack\.registry_file': registry file "
                                                                    r".*none\.json: no such file"),
        ({"stack": {"registry_file": str(tmp_path / "a-file")}}, r"key 'stack\.registry_file': .*not valid JSON"),
    ]
    for change, message in cases:
        with pytest.raises(PlanError, match=message):
            load_plan(write(tmp_path, {**data, **change}))
    data["stages"][0]["apply"] = "merged"
    with pytest.raises(PlanError, match="apply: merged restarts the stack's servers .* needs stack.configs"):
        load_plan(write(tmp_path, data))
    assert not (tmp_path / "run").exists()


def test_full_weights_served_as_an_adapter_are_refused_with_their_keys(tmp_path: Path) -> None:
    data = demo()
    for stage in data["stages"]:
        stage["apply"] = "lora"
    data["stages"][1]["optimize"]["args"]["finetune"] = "full"
    with pytest.raises(PlanError, match=r"stages\[1\]\.optimize\.args\.finetune: full .* stages\[1\]\.apply: lora "
                                        r"cannot serve"):
        load_plan(write(tmp_path, data))
    data["stages"][1]["apply"] = "none"
    assert load_plan(write(tmp_path, data)).stages[1].apply == "none"

    data = yaml.safe_load((REPO_ROOT / "scripts/train/async.yaml").read_text())
    data["optimize"]["args"]["finetune"] = "full"
    # mode: async serves full weights by reloading them: the embedded llama.cpp model cannot
    with pytest.raises(PlanError, match=r"key 'optimize\.args\.finetune': the stack's policy_model is models/llamacpp, "
                                        r"which cannot reload full weights"):
        load_plan(write(tmp_path, data))


def test_async_plans_check_their_tasks_files(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO_ROOT / "scripts/train/async.yaml").read_text())
    data["orchestrator"]["envs"][0]["input"] = str(tmp_path / "missing.jsonl")
    with pytest.raises(PlanError, match=r"key 'orchestrator\.envs\[0\]\.input': no such tasks file"):
        load_plan(write(tmp_path, data))


def test_overrides_reach_into_sections_and_name_themselves(tmp_path: Path) -> None:
    plan = load_plan(DEMO, {"stack.concurrency": 3, "validation.limit": 2})
    assert plan.stack.concurrency == 3 and plan.validation is not None and plan.validation.limit == 2
    tasks = str(REPO_ROOT / "resources_servers/weather/data/example.jsonl")
    plan = load_plan(DEMO, {"stages[0].collect.input": tasks, "stages[1].epochs": 3,
                            "stages[1].optimize.args.learning_rate": 1e-5})
    assert plan.stages[0].collect.input == tasks and plan.stages[1].epochs == 3
    assert plan.stages[1].optimize.args["learning_rate"] == 1e-5 and [e for e, _ in plan.epochs()] == [1, 2, 3, 4]
    from rollgym.train.loop.epochs import TrainLoop

    plan = load_plan(DEMO, {"stack.timeout_s": 30, "stack.max_attempts": 1, "output": str(tmp_path / "run")})
    options = TrainLoop(plan).collections.options(Path("tasks.jsonl"), Path("out.jsonl"), repeats=1, limit=None, params={})
    assert (options.concurrency, options.timeout_s, options.max_attempts, options.budget_s) == (2, 30.0, 1, None)
    for overrides, message in [
        ({"nope": 1}, r"override 'nope': the plan has no key 'nope' \(keys: base_model, output"),
        ({"output.x": 1}, r"override 'output\.x': 'output' is not a section of keys"),
        ({"stack..x": 1}, r"override 'stack\.\.x': a key is a plan key, or section\.key"),
        ({"stages[5].epochs": 2}, r"override 'stages\[5\]\.epochs': 'stages\[5\]' is not there \(the list has 2 items\)"),
        ({"stack[0]": 2}, r"override 'stack\[0\]': 'stack' is not a list"),
        ({"stages.epochs": 2}, r"override 'stages\.epochs': 'stages' is not a section of keys"),
        ({"stages[1].epochs": 0}, r"key 'stages\[1\]\.epochs': Input should be greater.* \(set by the override of "
                                  r"'stages\[1\]\.epochs'\)"),
        ({"stack.concurency": 1}, r"key 'stack\.concurency': unknown option \(set by the override of "
                                  r"'stack\.concurency'\)"),
        ({"seed": "x"}, r"key 'seed': Input should be a valid integer.* \(set by the override of 'seed'\)"),
    ]:
        with pytest.raises(PlanError, match=message):
            load_plan(DEMO, overrides)


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollgym.cli", *args], capture_output=True, text=True, timeout=60)


def test_commands_report_bad_input_in_one_line_with_exit_2(tmp_path: Path) -> None:
    """What a user meets on the command line: the file and key at fault, exit 2, no traceback."""
    plan = write(tmp_path, running_stack_plan(tmp_path))
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "orchestrator.yaml").write_text(
        f"batch_size: 2\nrollouts_per_example: 2\nenvs: [{{name: e, input: {tmp_path / 'missing.jsonl'}}}]\n")
    registry = str(tmp_path / "stack.json")
    cases = [
        (["train", str(plan), f"output={tmp_path / 'a-file'}"], "key 'output': "),
        (["train", str(plan), "output=[a"], "'output=[a': the value is not valid YAML"),
        (["train", str(plan), "stack.registry_file=nope.json"], "key 'stack.registry_file': registry file nope.json"),
        (["train", str(tmp_path)], "is a folder, not a plan file"),
        (["orchestrate", str(tmp_path / "orchestrator.yaml"), "--registry-file", registry, "--output", str(tmp_path)],
         "key 'envs[0].input': no such tasks file"),
        (["orchestrate", str(tmp_path / "orchestrator.yaml"), "--registry-file", registry, "--output",
          str(tmp_path / "a-file")], "is a file; a run's output is a folder"),
        (["orchestrate", str(tmp_path), "--registry-file", registry, "--output", str(tmp_path / "run")],
         "is a folder, not an orchestrator config"),
    ]
    for args, message in cases:
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
    assert not (tmp_path / "run").exists()


def test_a_validation_suite_adds_its_environments_to_the_stack_the_loop_starts(tmp_path: Path) -> None:
    data = demo()
    data["validation"] = {"suite": "smoke"}
    data["stack"]["agent"] = "weather_agent"  # the suite's environments bring their own agents
    plan = load_plan(write(tmp_path, data))
    configs = [Path(item).name for item in plan.stack.configs]
    assert configs == ["weather.yaml", "reverse_text.yaml", "mcq.yaml"]  # weather's config is there once
    assert plan.stack.overrides[0] == "policy_model.n_ctx=2048"  # the suite's overrides first: the plan's win
    data["validation"] = {"suite": "smoke", "input": "x.jsonl"}
    with pytest.raises(PlanError, match="validation takes input .* or suite .*, not both"):
        load_plan(write(tmp_path, data))


def test_a_nat_curriculum_learning_section_loads_under_curate(tmp_path: Path) -> None:
    data = demo()
    data["stages"][1]["curate"] = {"curriculum": {"enabled": True, "initial_percentile": 0.5, "sort_ascending": True}}
    curriculum = load_plan(write(tmp_path, data)).stages[1].curate.curriculum
    assert curriculum is not None and curriculum.sort == "hard_to_easy" and curriculum.initial_percentile == 0.5
    data["stages"][1]["curate"]["curriculum"]["sort_ascending"] = "yes"
    with pytest.raises(PlanError, match=r"key 'stages\[1\]\.curate\.curriculum': sort_ascending: true \(hard to easy\)"):
        load_plan(write(tmp_path, data))
