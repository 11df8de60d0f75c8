"""The epoch loop over a real stack (the scripted backend behind chat_completions, the weather
environment and its agent, served in-process): history and plot, resume after an interruption in
every phase and after a SIGKILL during optimize, a failed step's cause, and stale rollouts.

The trainer is tests/train/toy_trainers.py's CountingTrainer: a real adapter run in a child process
that trains nothing, so these tests cost seconds; the TRL trainers have their own tests."""

from __future__ import annotations

import importlib.util

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT
from rollgym.data.jsonl import read_whole_lines as read_rollouts
from rollgym.train.loop.epochs import TrainError, TrainLoop
from rollgym.train.loop.plan import load_plan

TOY = "tests.train.toy_trainers"
TASKS = REPO_ROOT / "resources_servers/weather/data/example.jsonl"


@pytest.fixture(autouse=True)
def toys(importable_toys: None) -> None:
    """Every test here runs a toy adapter in a child process."""


@pytest.fixture()
def registry_file(scripted_agents: dict[str, ServerAddress], tmp_path: Path) -> Path:
    path = tmp_path / "stack.json"
    path.write_bytes(orjson.dumps({name: {"url": a.url, "role": a.role} for name, a in scripted_agents.items()}))
    return path


def make_plan(tmp_path: Path, registry_file: Path, **changes: Any) -> Path:
    plan: dict[str, Any] = {
        "output": str(tmp_path / "run"),
        "stack": {"registry_file": str(registry_file), "agent": "weather_agent", "concurrency": 4},
        "validation": {"input": str(TASKS), "repeats": 2, "limit": 2},
        "stages": [{
            "name": "sft", "epochs": 2,
            "collect": {"input": str(TASKS), "repeats": 2, "limit": 3},
            "curate": {"min_reward": 1.0, "top_k_per_group": 1},
            "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft"},
            "apply": "none",
        }],
        "guard": {"max_drop": 0.2},
    }
    for key, value in changes.items():
        plan[key] = value
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def calls(tmp_path: Path) -> list[list[str]]:
    log = tmp_path / "run" / "calls.log"
    return [line.split() for line in log.read_text().splitlines()] if log.is_file() else []


def test_a_plan_runs_its_epochs(tmp_path: Path, registry_file: Path) -> None:
    loop = TrainLoop(load_plan(make_plan(tmp_path, registry_file)), progress=False)
    state = loop.run()
    history = loop.history()
    assert [line["epoch"] for line in history] == [0, 1, 2]
    first = history[1]
    assert first["train"]["mean_reward"] == 1.0 and first["train"]["rollouts"] == 6
    assert first["curated"]["records"] == 3 and first["curated"]["dropped"] == {"not_top_k": 3}
    assert first["validation"]["mean_reward"] == 1.0 and first["validation"]["pass@2"] == 1.0
    assert set(first["phases_s"]) == {"collect", "curate", "optimize", "apply", "validate"}
    assert first["overhead_s"] >= 0 and first["guard"] == {"ok": True}
    # Epoch 2 trains on from epoch 1's artefact.
    assert [c[0] for c in calls(tmp_path)] == ["policy-e001", "policy-e002"]
    assert calls(tmp_path)[1][2] == history[1]["artefact"]
    assert (tmp_path / "run" / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert state["best"]["reward"] == 1.0 and not state["stopped"]
    if importlib.util.find_spec("tensorboard"):  # the history's numbers also went to the default tracker
        assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))


class Interrupted(BaseException):
    """Stands for Ctrl-C or a crash of the loop itself."""


@pytest.mark.parametrize("phase", ["collect", "curate", "optimize", "apply", "validate"])
def test_resume_after_an_interruption_in_each_phase(tmp_path: Path, registry_file: Path, phase: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop dies in epoch 2's `phase` (after that phase's work is on disk, before it is recorded);
    the rerun finishes the plan without repeating a rollout or a training step."""
    import rollgym.train.loop.epochs as loop_module
    from rollgym.train.loop.apply import Serving
    from rollgym.train.loop.collect import Collections
    from rollgym.train.loop.validation import Validation

    plan = load_plan(make_plan(tmp_path, registry_file))
    patches = {
        "collect": (Collections, "run"), "curate": (loop_module, "curate"),
        "optimize": (TrainLoop, "_optimize"), "apply": (Serving, "apply"), "validate": (Validation, "validate"),
    }
    owner, name = patches[phase]
    original = getattr(owner, name)

    def in_epoch_two(args: tuple, kwargs: dict) -> bool:
        if phase == "collect":
            return args[2] == "epoch 2 collect"
        if phase == "curate":
            return kwargs["epoch"] == 1
        if phase == "apply":
            return True  # apply none: only called by epoch phases
        return args[1] == 2

    def interrupt(*args: Any, **kwargs: Any) -> Any:
        if not in_epoch_two(args, kwargs):
            return original(*args, **kwargs)
        if phase == "collect":
            args[1].limit = 1  # a part of the collection is on disk
        if phase != "curate":
            original(*args, **kwargs)
        raise Interrupted

    if phase == "apply":
        monkeypatch.setattr(Serving, "apply", lambda self, artefact, mode: interrupt(self, artefact, mode)
                            if (self.plan.output and (Path(self.plan.output) / "epoch-002" / "curated.jsonl").is_file())
                            else original(self, artefact, mode))
    else:
        monkeypatch.setattr(owner, name, interrupt)
    with pytest.raises(Interrupted):
        TrainLoop(plan, progress=False).run()
    monkeypatch.undo()
    loop = TrainLoop(plan, progress=False)
    loop.run()
    assert [line["epoch"] for line in loop.history()] == [0, 1, 2]
    rollouts = read_rollouts(tmp_path / "run" / "epoch-002" / "rollouts.jsonl")
    ids = [r["rollout_id"] for r in rollouts]
    assert len(ids) == len(set(ids)) == 6, "a resumed collection repeated or lost rollouts"
    trained = [c[0] for c in calls(tmp_path)]
    assert trained == ["policy-e001", "policy-e002"], f"optimize was redone or skipped: {trained}"
    assert len(read_rollouts(tmp_path / "run" / "epoch-002" / "validation.jsonl")) == 4


def test_resume_after_sigkill_during_optimize(tmp_path: Path, registry_file: Path) -> None:
    plan = make_plan(tmp_path, registry_file, stages=[{
        "name": "sft", "epochs": 1, "collect": {"input": str(TASKS), "repeats": 2, "limit": 2},
        "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft", "args": {"sleep_s": 60}},
        "apply": "none"}])
    command = [sys.executable, "-m", "rollgym.cli", "train", str(plan), "--no-progress"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not calls(tmp_path) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.2)
    assert calls(tmp_path), f"the trainer never started: {process.stderr.read().decode() if process.stderr else ''}"
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    time.sleep(1.0)
    job = orjson.loads((tmp_path / "run" / "epoch-001" / "train" / "job.json").read_bytes())
    trainers = subprocess.run(["pgrep", "-f", "rollgym.train.trainers.jobs .*" + str(tmp_path)], capture_output=True, text=True)
    assert not trainers.stdout.strip(), "the killed loop left its trainer running"
    # Run again, with a trainer that does not sleep: the step is redone (it never finished), then the rest.
    data = yaml.safe_load(plan.read_text())
    data["stages"][0]["optimize"]["args"] = {"sleep_s": 0}
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(TrainError, match="holds a run of another plan"):
        TrainLoop(load_plan(plan), progress=False).run()
    (tmp_path / "run" / "plan.json").unlink()  # the plan was changed on purpose: accept it
    loop = TrainLoop(load_plan(plan), progress=False)
    loop.run()
    assert [line["epoch"] for line in loop.history()] == [0, 1]
    assert job["trainer"].endswith("CountingTrainer")
    assert len(calls(tmp_path)) == 2 and len(read_rollouts(tmp_path / "run" / "epoch-001" / "rollouts.jsonl")) == 4


def test_a_resumed_run_may_change_how_it_retries_and_guards_not_what_it_trains(tmp_path: Path,
                                                                             registry_file: Path) -> None:
    plan = make_plan(tmp_path, registry_file)
    TrainLoop(load_plan(plan), progress=False).run()
    data = yaml.safe_load(plan.read_text())
    data["stack"].update(max_attempts=5, timeout_s=30.0)
    data["guard"] = {"max_drop": 0.5, "accept": {"mean_reward": 0.1}}
    plan.write_text(yaml.safe_dump(data))
    # How a step is computed, not what it computes: a run killed for memory resumes with smaller micro-batches.
    data["stages"][0]["optimize"]["args"] = {"micro_batch_tokens": 512, "threads": 1}
    plan.write_text(yaml.safe_dump(data))
    loop = TrainLoop(load_plan(plan), progress=False)
    loop.run()  # taken: nothing left to do, nothing redone
    assert [line["epoch"] for line in loop.history()] == [0, 1, 2] and len(calls(tmp_path)) == 2
    data["stages"][0]["optimize"]["args"]["learning_rate"] = 0.5
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(TrainError, match=r"keys differ: stages\)"):
        TrainLoop(load_plan(plan), progress=False).run()
    del data["stages"][0]["optimize"]["args"]["learning_rate"]
    data["stages"][0]["curate"]["min_reward"] = 0.5
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(TrainError, match=r"keys differ: stages\).*may change only stack\.concurrency"):
        TrainLoop(load_plan(plan), progress=False).run()


def test_a_failed_step_stops_with_its_cause(tmp_path: Path, registry_file: Path) -> None:
    plan = make_plan(tmp_path, registry_file, stages=[{
        "name": "sft", "collect": {"input": str(TASKS), "repeats": 2, "limit": 2},
        "optimize": {"trainer": f"{TOY}:CrashingTrainer", "data": "sft"}, "apply": "none"}])
    with pytest.raises(TrainError, match=r"epoch 1 \(sft\) optimize with .*CrashingTrainer(.|\n)*CUDA out of memory"):
        TrainLoop(load_plan(plan), progress=False).run()
    nothing = make_plan(tmp_path, registry_file, output=str(tmp_path / "run2"), stages=[{
        "name": "sft", "collect": {"input": str(TASKS), "repeats": 2, "limit": 2}, "curate": {"min_reward": 2.0},
        "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft"}, "apply": "none"}])
    # Usable rollouts that teach nothing (none reaches min_reward) are not a failure: the epoch trains no
    # step, says why, keeps the served model, and the run goes on.
    loop = TrainLoop(load_plan(nothing), progress=False)
    loop.run()
    line = loop.history()[1]
    assert line["skipped"] == "nothing to learn from: the rollouts were usable, but {'below_min_reward': 4}"
    assert line["artefact"] is None and line["validation"] is None and line["curated"]["records"] == 0
    assert not (tmp_path / "run2" / "calls.log").exists(), "a training step ran on no data"
    assert loop.state["last"] is None and (tmp_path / "run2" / "reward.png").is_file()


def test_a_collection_where_every_rollout_failed_is_not_recorded(tmp_path: Path, registry_file: Path) -> None:
    """A stack that is down fails every rollout: the run stops with a cause, and once the stack is up
    the same command collects again instead of finding an empty collection it took as done."""
    live = registry_file.read_bytes()
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}"
    registry_file.write_bytes(orjson.dumps({"policy_model": dead, "weather_agent": {"url": dead, "role": "agents"}}))
    plan = make_plan(tmp_path, registry_file, validation=None, guard=None)
    with pytest.raises(TrainError, match=r"epoch 1 collect: every rollout failed \(agent_error: 6\), e\.g\. .*"
                                         r"connect.*; all causes in .*rollouts\.failures\.jsonl"):
        TrainLoop(load_plan(plan), progress=False).run()
    assert not (tmp_path / "run" / "epoch-001" / "phases.json").exists()
    registry_file.write_bytes(live)
    loop = TrainLoop(load_plan(plan), progress=False)
    loop.run()
    assert [line["train"]["rollouts"] for line in loop.history()] == [6, 6]


def test_rollouts_of_another_version_are_excluded(tmp_path: Path, registry_file: Path) -> None:
    """The served model is not the one the loop applied (another process swapped it): every rollout is
    stale, is counted, and nothing is trained on."""
    loop = TrainLoop(load_plan(make_plan(tmp_path, registry_file, validation=None, guard=None)), progress=False)
    loop.serving.start()
    loop.serving.version = "policy-e007"  # what the loop believes it applied; the backend serves "scripted"
    loop.state = {"applied": None, "best": None, "last": None, "stopped": None}
    with pytest.raises(TrainError, match=r"nothing left to train on after curation \(\{'stale': 6\}\)"):
        loop._epoch(1, loop.plan.stages[0], "none")


def test_replayed_rollouts_train_offline_or_beside_live_ones(tmp_path: Path, registry_file: Path) -> None:
    """A stage can train on rollouts files (an earlier collection) instead of, or besides, collecting:
    curated alike, and never dropped as stale (they are off-policy by design)."""
    for name in "abcd":
        (tmp_path / name).mkdir()
    first = TrainLoop(load_plan(make_plan(tmp_path / "a", registry_file, stages=[{
        "name": "sft", "collect": {"input": str(TASKS), "repeats": 2, "limit": 3},
        "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft"}, "apply": "none"}])), progress=False)
    first.run()
    earlier = tmp_path / "a" / "run" / "epoch-001" / "rollouts.jsonl"
    assert len(read_rollouts(earlier)) == 6
    offline = {"name": "offline", "replay": [str(earlier)], "optimize": {"trainer": f"{TOY}:CountingTrainer",
                                                                        "data": "sft"}, "apply": "none"}
    mixed = {**offline, "name": "mixed", "collect": {"input": str(TASKS), "repeats": 2, "limit": 1}}
    loop = TrainLoop(load_plan(make_plan(tmp_path / "b", registry_file, stages=[offline, mixed])), progress=False)
    loop.run()
    lines = {line["stage"]: line for line in loop.history() if line["epoch"] > 0}
    assert lines["offline"]["train"]["rollouts"] == 0
    assert lines["offline"]["curated"]["rollouts_in"] == 6 and lines["offline"]["curated"]["replayed"] == 6
    assert lines["offline"]["curated"]["records"] == 6 and "stale" not in lines["offline"]["curated"]["dropped"]
    assert lines["mixed"]["train"]["rollouts"] == 2 and lines["mixed"]["curated"]["rollouts_in"] == 8
    assert lines["mixed"]["curated"]["replayed"] == 6
    with pytest.raises(Exception, match=r"key 'stages\[0\]\.replay\[0\]': no such rollouts file: nope\.jsonl"):
        load_plan(make_plan(tmp_path / "c", registry_file, stages=[{**offline, "replay": ["nope.jsonl"]}]))
    with pytest.raises(Exception, match=r"a stage trains on collect \(live rollouts\), replay \(rollouts files\), or both"):
        load_plan(make_plan(tmp_path / "d", registry_file, stages=[{k: v for k, v in offline.items() if k != "replay"}]))


def test_a_run_rewound_to_an_earlier_epoch_trains_on_from_its_weights(tmp_path: Path, registry_file: Path) -> None:
    """`--rewind 1` after three epochs: epochs 2 and 3 are moved aside (not deleted), history and state
    are epoch 1's again, and the rerun trains epoch 2 from epoch 1's adapter."""
    plan = make_plan(tmp_path, registry_file)
    data = yaml.safe_load(plan.read_text())
    data["stages"][0]["epochs"] = 3
    plan.write_text(yaml.safe_dump(data))
    first = TrainLoop(load_plan(plan), progress=False)
    first.run()
    epoch_1 = first.history()[1]["artefact"]
    with pytest.raises(TrainError, match=r"epoch 7 is not a finished epoch of this run \(finished: 0\.\.3\)"):
        TrainLoop(load_plan(plan), progress=False, rewind_to=7).run()
    rewound = TrainLoop(load_plan(plan), progress=False, rewind_to=1)
    rewound.run()
    assert [line["epoch"] for line in rewound.history()] == [0, 1, 2, 3]
    assert [c[0] for c in calls(tmp_path)] == ["policy-e001", "policy-e002", "policy-e003", "policy-e002",
                                               "policy-e003"]
    assert calls(tmp_path)[3][2] == epoch_1  # trained on from epoch 1's weights
    [aside] = (tmp_path / "run" / "rewound").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["epoch-002", "epoch-003", "history.jsonl"]
    assert [line["epoch"] for line in read_rollouts(aside / "history.jsonl")] == [2, 3]
    assert read_rollouts(aside / "epoch-002" / "rollouts.jsonl")  # the discarded epochs' data is kept


def test_a_stage_with_levels_moves_to_harder_tasks_once_an_epoch_reaches_advance_at(tmp_path: Path,
                                                                                     registry_file: Path) -> None:
    rows = read_rollouts(TASKS)
    easy, hard = tmp_path / "easy.jsonl", tmp_path / "hard.jsonl"
    easy.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows[:2]))
    hard.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows[2:]))
    plan = make_plan(tmp_path, registry_file, stages=[{
        "name": "sft", "epochs": 3, "collect": {"levels": [str(easy), str(hard)], "advance_at": 0.9, "repeats": 2},
        "curate": {"min_reward": 1.0, "top_k_per_group": 1},
        "optimize": {"trainer": f"{TOY}:CountingTrainer", "data": "sft"}, "apply": "none"}])
    said: list[str] = []
    state = TrainLoop(load_plan(plan), progress=False, log=said.append).run()
    history = TrainLoop(load_plan(plan), progress=False).history()
    assert [line.get("level") for line in history] == [None, 0, 1, 1]  # the last level is kept
    cities = {epoch: {r["city"] for r in read_rollouts(tmp_path / "run" / f"epoch-00{epoch}" / "rollouts.jsonl")}
              for epoch in (1, 2, 3)}
    assert cities[1] == {row["city"] for row in rows[:2]} and cities[2] == {row["city"] for row in rows[2:]}
    assert state["levels"] == {"sft": 1} and any("level 2 of 2" in line for line in said)
    data = yaml.safe_load(plan.read_text())
    data["stages"][0]["collect"]["input"] = str(TASKS)
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match="collect takes input .* or levels .*, not both"):
        load_plan(plan)


def test_validation_can_name_an_eval_suite(tmp_path: Path, registry_file: Path) -> None:
    """Each environment of the suite validates into its own file; the epoch's figure is their mean."""
    rows = read_rollouts(TASKS)
    for name, part in (("paris", rows[:1]), ("others", rows[1:3])):
        (tmp_path / f"{name}.jsonl").write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in part))
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"repeats": 2, "environments": {
        name: {"config": str(REPO_ROOT / "resources_servers/weather/configs/weather.yaml"),
               "tasks": str(tmp_path / f"{name}.jsonl"), "agent": "weather_agent"} for name in ("paris", "others")}}))
    plan = make_plan(tmp_path, registry_file, validation={"suite": str(suite)})
    data = yaml.safe_load(plan.read_text())
    data["stages"][0]["epochs"] = 1
    plan.write_text(yaml.safe_dump(data))
    loop = TrainLoop(load_plan(plan), progress=False)
    loop.run()
    validation = loop.history()[1]["validation"]
    assert set(validation["environments"]) == {"paris", "others"} and validation["suite"] == str(suite)
    assert validation["environments"]["others"]["rollouts"] == 4 and validation["mean_reward"] == 1.0
    assert len(read_rollouts(tmp_path / "run" / "epoch-001" / "validation-paris.jsonl")) == 2
    data["validation"] = {"suite": "no-such-suite"}
    plan.write_text(yaml.safe_dump(data))
    with pytest.raises(Exception, match=r"key 'validation.suite': suite 'no-such-suite': no such file, nor a "
                                        r"bundled suite \(bundled: reasoning-gym, smoke\)"):
        load_plan(plan)


def test_a_run_saved_before_keys_were_renamed_or_added_is_the_same_plan(tmp_path: Path, registry_file: Path) -> None:
    """plan.json as an older rollgym wrote it: `optimize.adapter` (now `trainer`) and no key added since
    (`curate.segments`): the same plan, so the run resumes; a real change still refuses."""
    from rollgym.train.loop.run_folder import RunFolder

    plan = load_plan(make_plan(tmp_path, registry_file))
    current = plan.model_dump(mode="json")
    older = orjson.loads(orjson.dumps(current))
    stage = older["stages"][0]
    stage["optimize"]["adapter"] = stage["optimize"].pop("trainer")
    del stage["curate"]["segments"]
    folder = RunFolder(Path(plan.output), "epoch")
    folder.root.mkdir(parents=True)
    (folder.root / "plan.json").write_bytes(orjson.dumps(older))
    assert folder.refusal(current) is None
    stage["curate"]["min_reward"] = 0.5
    (folder.root / "plan.json").write_bytes(orjson.dumps(older))
    assert "keys differ: stages" in (folder.refusal(current) or "")
