"""`rollgym train PLAN --check`: every problem of a plan listed with exit 2, or exit 0 and where a run in the
output folder would continue; nothing is started and the output folder is never written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rollgym.cli import main
from rollgym.testing import REPO_ROOT
from rollgym.train.loop.plan import load_plan
from rollgym.train.loop.run_folder import RunFolder

DEMO = REPO_ROOT / "scripts/train/weather.yaml"


def demo(tmp_path: Path) -> dict:
    data = yaml.safe_load(DEMO.read_text())
    data["output"] = str(tmp_path / "run")
    for key in ("configs",):
        data["stack"][key] = [str(REPO_ROOT / item) for item in data["stack"][key]]
    data["validation"]["input"] = str(REPO_ROOT / data["validation"]["input"])
    for stage in data["stages"]:
        stage["collect"]["input"] = str(REPO_ROOT / stage["collect"]["input"])
    return data


def write(tmp_path: Path, data: dict, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def check(capsys: pytest.CaptureFixture[str], plan: Path, *extra: str) -> tuple[int, str, str]:
    code = main(["train", str(plan), *extra, "--check"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def started_run(tmp_path: Path, data: dict) -> RunFolder:
    """The output folder as `rollgym train` leaves it after claiming it for `data`'s plan."""
    plan = load_plan(write(tmp_path, data, "started.yaml"))
    folder = RunFolder(Path(plan.output), "epoch")
    folder.claim(plan.model_dump(mode="json"))
    return folder


def test_a_valid_plan_exits_0_and_starts_nothing(tmp_path: Path) -> None:
    """Through the installed entry point, in a child process: the demo plan (whose stack would start the
    embedded model) is checked in seconds, and its output folder is not created."""
    data = demo(tmp_path)
    plan = write(tmp_path, data)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-m", "rollgym.cli", "train", str(plan), "--check"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    assert f"{plan}: ok (mode epochs, 2 epochs; rs-sft: 1 x trl_sft, apply merged" in result.stdout
    assert f"output {data['output']}: a new run" in result.stdout
    assert not (tmp_path / "run").exists()
    assert "stack ready" not in result.stderr and "Traceback" not in result.stderr


def test_every_file_problem_is_listed_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = demo(tmp_path)
    data["stages"][1]["collect"]["input"] = str(tmp_path / "no-train.jsonl")
    data["validation"]["input"] = str(tmp_path / "no-validation.jsonl")
    data["base_model"] = str(tmp_path / "missing.gguf")
    code, out, err = check(capsys, write(tmp_path, data))
    assert code == 2 and out == ""
    assert "3 problems; nothing started" in err
    for key in ("stages[1].collect.input", "validation.input", "base_model"):
        assert f"key '{key}'" in err, err
    assert not (tmp_path / "run").exists()



def test_a_teachers_adapter_folder_is_checked_and_overrides_may_follow_the_option(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = demo(tmp_path)
    data["stages"][1]["teacher"] = {"server": "policy_model", "lora_path": str(tmp_path / "adapter")}
    data["stages"][1]["optimize"] = {"trainer": "grpo", "args": {"loss": {"objective": "surogate", "teacher_tau": 1.0}}}
    plan = write(tmp_path, data)
    code = main(["train", str(plan), "--check", f"output={tmp_path / 'other'}"])  # the override after --check
    err = capsys.readouterr().err
    assert code == 2 and "1 problem; nothing started" in err
    assert f"key 'stages[1].teacher.lora_path': no such adapter folder: {tmp_path / 'adapter'}" in err
    (tmp_path / "adapter").mkdir()
    code, out, err = check(capsys, plan, f"output={tmp_path / 'other'}")
    assert code == 0 and str(tmp_path / "other") in out, err
    # A teacher at a URL loads its adapter from its own disk: nothing here to check.
    data["stages"][1]["teacher"] = {"server": "http://127.0.0.1:9", "lora_path": "/on/the/teacher"}
    assert check(capsys, write(tmp_path, data))[0] == 0


def test_key_errors_and_missing_files_are_listed_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A key error does not hide the files of the sections that are valid, nor a second problem of the plan as a
    whole the first: one run of --check lists them all, each line with the file and its key."""
    data = demo(tmp_path)
    data["stages"][0]["curate"]["min_rewad"] = 1.0  # a misspelt key
    data["stages"][1]["optimize"]["args"].update(clip_hihg=0.3, learning_rate="fast")  # two bad arguments
    data["stages"][1]["collect"]["input"] = str(tmp_path / "no-train.jsonl")
    data["validation"]["input"] = str(tmp_path / "no-validation.jsonl")
    path = write(tmp_path, data)
    code, out, err = check(capsys, path)
    lines = err.splitlines()[1:]
    assert code == 2 and err.splitlines()[0] == f"{path}: {len(lines)} problems; nothing started"
    expected = [f"{path}: key 'stages[0].curate.min_rewad': unknown option",
                f"{path}: key 'stages[1].optimize': args.clip_hihg: Extra inputs are not permitted",
                f"{path}: key 'stages[1].optimize': args.learning_rate: Input should be a valid number",
                f"{path}: key 'stages[1].collect.input': no such tasks file",
                f"{path}: key 'validation.input': no such tasks file"]
    assert len(lines) == len(expected), err
    for want in expected:
        assert sum(line.strip().startswith(want) for line in lines) == 1, (want, err)

    data = demo(tmp_path)  # the plan as a whole: both of its problems
    data["stages"][1]["optimize"]["args"]["temperature"] = 0.7
    data["stages"][0]["apply"] = "lora"
    code, out, err = check(capsys, write(tmp_path, data))
    assert code == 2 and "2 problems" in err
    assert "stages mix apply modes ['lora', 'merged']" in err and "args.temperature 0.7 disagrees" in err
    assert all(line.strip().startswith(f"{path}: key '(top level)': ") for line in err.splitlines()[1:])


@pytest.mark.parametrize(("change", "message"), [
    (lambda p: p["stages"][1]["optimize"]["args"].update(temperature=0.7),
     "stages[1].optimize.args.temperature 0.7 disagrees with stages[1].collect.params.temperature 1.0"),
    (lambda p: p["stages"][1].update(apply="lora"), "stages mix apply modes ['lora', 'merged']"),
    (lambda p: p["stages"][1]["optimize"]["args"].update(clip_hihg=0.3), "args.clip_hihg"),
    (lambda p: p["guard"].update(accept={"pass@4": 0.5}),
     "key 'guard.accept': 'pass@4' is never measured: validation with 3 repeats measures pass@1, pass@2, pass@3"),
])
def test_plan_mistakes_exit_2_naming_the_key(tmp_path: Path, capsys: pytest.CaptureFixture[str], change,
                                            message: str) -> None:
    data = demo(tmp_path)
    change(data)
    code, out, err = check(capsys, write(tmp_path, data))
    assert code == 2 and message in err and "Traceback" not in err, err


def test_an_output_holding_another_plans_run_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = demo(tmp_path)
    started_run(tmp_path, {**data, "seed": 1})
    before = sorted(path.name for path in (tmp_path / "run").iterdir())
    code, out, err = check(capsys, write(tmp_path, data))
    assert code == 2
    assert "key 'output':" in err and "holds a run of another plan (keys differ: seed)" in err
    assert sorted(path.name for path in (tmp_path / "run").iterdir()) == before
    # An override that makes it the same plan again is accepted, as the run would be.
    code, out, err = check(capsys, write(tmp_path, data), "seed=1")
    assert code == 0 and "holds a run of this plan, 0 epochs finished" in out, err


def test_a_resumable_change_is_accepted_and_the_resume_point_reported(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    data = demo(tmp_path)
    folder = started_run(tmp_path, data)
    base = {"applied": None, "best": None, "last": None, "stopped": None}
    folder.append_history({"epoch": 0, "validation": {"mean_reward": 0.2}}, base)
    weights = folder.unit_dir(1) / "train" / "adapter"
    weights.mkdir(parents=True)
    applied = {"kind": "lora", "uri": str(weights), "base_model": "bundled", "version": "policy-e001"}
    state = {**base, "applied": applied, "last": applied}
    folder.save_state(state)
    folder.append_history({"epoch": 1, "stage": "rs-sft"}, state)
    (folder.unit_dir(2)).mkdir()
    (folder.unit_dir(2) / "phases.json").write_text('{"collect": {"s": 1.0}, "curate": {"s": 0.1}}')
    changed = {**data, "stack": {**data["stack"], "concurrency": 4}, "guard": {"max_drop": 0.5}}
    code, out, err = check(capsys, write(tmp_path, changed))
    assert code == 0, err
    assert ("holds a run of this plan, 1 epoch finished; applies policy-e001 again; continues with epoch 2 "
            "(stage grpo), its collect, curate phases already done") in out
    code, out, err = check(capsys, write(tmp_path, changed), "--rewind", "0")
    assert code == 0 and "after the rewind to epoch 0" in out and "continues with epoch 1 (stage rs-sft)" in out, err
    assert "applies" not in out  # epoch 0's state: the base model
    code, out, err = check(capsys, write(tmp_path, changed), "--rewind", "5")
    assert code == 2
    assert f"--rewind 5: {folder.root}: epoch 5 is not a finished epoch of this run (finished: 0..1)" in err
    weights.rmdir()  # epoch 1's weights gone: it cannot be rewound to, epoch 0 still can
    code, out, err = check(capsys, write(tmp_path, changed), "--rewind", "1")
    assert code == 2 and f"--rewind 1: cannot rewind to epoch 1: its weights {weights} are gone" in err
    assert "epochs it can rewind to: 0" in err
    weights.mkdir()

    folder.append_history({"epoch": 2, "stage": "grpo"}, state)
    code, out, err = check(capsys, write(tmp_path, changed))
    assert code == 0 and "2 epochs finished" in out and "every epoch of the plan is finished" in out
    folder.save_state({**state, "stopped": "validation reward fell"})
    code, out, err = check(capsys, write(tmp_path, changed))
    assert code == 0 and "it stopped (validation reward fell): nothing to run" in out


def test_an_output_that_is_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = demo(tmp_path)
    (tmp_path / "run").write_text("x")
    code, out, err = check(capsys, write(tmp_path, data))
    assert code == 2 and f"key 'output': {tmp_path / 'run'} is a file; a run's output is a folder" in err


def test_an_async_plan_reports_the_step_it_would_continue_with(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    tasks = str(REPO_ROOT / "resources_servers/reverse_text/data/example.jsonl")
    (tmp_path / "stack.json").write_text('{"agent": {"url": "http://127.0.0.1:9", "role": "agents"}}')
    data = {"output": str(tmp_path / "run"), "mode": "async", "stack": {"registry_file": str(tmp_path / "stack.json")},
            "validation": {"input": tasks, "repeats": 1},
            "orchestrator": {"batch_size": 4, "rollouts_per_example": 2, "max_steps": 5,
                             "envs": [{"name": "reverse", "input": tasks}]},
            "optimize": {"trainer": "trl_sft"}}
    path = write(tmp_path, data)
    code, out, err = check(capsys, path)
    assert code == 0 and "mode async, trainer trl_sft, 5 steps" in out, err
    assert f"output {tmp_path / 'run'}: a new run" in out
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("x")
    code, out, err = check(capsys, path)
    assert code == 2 and "is not empty and holds no run (no plan.json)" in err
    (tmp_path / "run" / "notes.txt").unlink()
    plan = load_plan(path)
    folder = RunFolder(Path(plan.output), "step")
    folder.claim(plan.model_dump(mode="json"))
    state = folder.read_state()
    for step in (0, 1, 2):
        folder.append_history({"epoch": step, "step": step}, state)
    code, out, err = check(capsys, path)
    assert code == 0 and "holds a run of this plan, 2 steps finished; continues with step 3 of 5" in out, err
