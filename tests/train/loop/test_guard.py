"""The guard with the real embedded model and apply: merged: a step whose validation reward falls
below the best is rolled back (the best weights are served again) and the plan stops."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from rollgym.testing import REPO_ROOT

pytestmark = pytest.mark.slow

MISSING = next((m for m in ("gguf", "llama_cpp", "matplotlib") if importlib.util.find_spec(m) is None), None)
if MISSING:
    pytest.skip(f"{MISSING} is not installed (pip install -e '.[train,llamacpp]')", allow_module_level=True)


def test_guard_restores_the_best_model(tmp_path: Path, importable_toys: None) -> None:
    from rollgym.train.loop.epochs import TrainLoop
    from rollgym.train.loop.plan import load_plan
    from rollgym.train.trainers.policy import bundled_gguf

    try:
        bundled_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tasks = str(REPO_ROOT / "resources_servers/reverse_text/data/example.jsonl")
    greedy = {"temperature": 0.0, "max_output_tokens": 12}
    plan = {
        "output": str(tmp_path / "run"),
        "stack": {"configs": [str(REPO_ROOT / "resources_servers/reverse_text/configs/reverse_text.yaml")],
                  "overrides": ["policy_model.n_ctx=1024"], "concurrency": 1},
        # All five tasks: the base model copies the first one's text back (reward 0), and the noised weights
        # need a mean above 0 to fall from.
        "validation": {"input": tasks, "limit": 5, "repeats": 1, "params": greedy},
        "stages": [{"name": "toy", "epochs": 3, "collect": {"input": tasks, "limit": 1, "repeats": 1, "params": greedy},
                    "optimize": {"trainer": "tests.train.toy_trainers:GgufTrainer", "data": "sft"}, "apply": "merged"}],
        "guard": {"max_drop": 0.0, "on_violation": "stop"},
    }
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    loop = TrainLoop(load_plan(path), progress=False)
    state = loop.run()
    history = loop.history()
    base, same, broken = (line["validation"]["mean_reward"] for line in history)
    assert [line["epoch"] for line in history] == [0, 1, 2], "the plan went on after the guard stopped it"
    assert history[1]["model_version"] == "policy-e001" and same == pytest.approx(base)
    assert broken < base, f"the noised weights did not do worse ({broken} vs {base}): the test proves nothing"
    assert history[2]["guard"] == {"ok": False, "reward": broken, "best": base, "restored": "policy-base",
                                   "action": "stop"}
    assert history[2]["model_version"] == "policy-base"
    assert loop.serving.model_path and loop.serving.model_path.endswith("policy-base.gguf")
    assert state["applied"] is None and "fell more than 0.0 below the best" in state["stopped"]
    assert not (tmp_path / "run" / "epoch-002" / "train" / "policy-e002.gguf").exists(), "the broken GGUF was kept"


def test_acceptance_thresholds_keep_or_roll_back_an_epoch(tmp_path: Path) -> None:
    """guard.accept: an epoch's model stays only if every listed validation metric reaches its threshold."""
    import orjson

    from rollgym.train.loop.epochs import TrainLoop
    from rollgym.train.loop.guard import guard_problems
    from rollgym.train.loop.plan import PlanError, load_plan
    from rollgym.train.trainers.base import Artefact

    assert guard_problems({"mean_reward": 0.5, "pass@4": 0.7}, {"reward": 0.55}, 0.1, {"pass@4": 0.8}) == [
        "validation pass@4 0.700 is below the accepted 0.8"]
    assert guard_problems({"mean_reward": 0.3}, {"reward": 0.55}, 0.1, {}) == [
        "validation reward 0.300 fell more than 0.1 below the best 0.550"]
    assert guard_problems({"mean_reward": 0.3}, {"reward": 0.55}, None, {"mean_reward": 0.2}) == []
    assert guard_problems({"mean_reward": 0.3}, None, 0.1, {"pass@2": 0.5}) == [
        "validation pass@2 missing is below the accepted 0.5"]

    registry = tmp_path / "stack.json"
    registry.write_bytes(orjson.dumps({"agent": {"url": "http://127.0.0.1:9", "role": "agents"}}))
    tasks = str(REPO_ROOT / "resources_servers/weather/data/example.jsonl")
    plan = {"output": str(tmp_path / "run"), "stack": {"registry_file": str(registry)},
            "validation": {"input": tasks},
            "stages": [{"name": "s", "collect": {"input": tasks}, "optimize": {"trainer": "trl_sft"}, "apply": "none"}],
            "guard": {"max_drop": None, "accept": {"mean_reward": 0.5, "pass@4": 0.9}, "on_violation": "stop"}}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    loop = TrainLoop(load_plan(path), progress=False)
    loop.output.mkdir()
    loop.state = {"applied": None, "best": {"reward": 0.2, "artefact": None, "version": "base"}, "last": None}
    artefact = Artefact(kind="lora", uri="/x", base_model="bundled", version="policy-e001")
    def check(summary: dict, artefact: Artefact) -> dict | None:
        return loop.guard.check(loop.state, summary, artefact, artefact.version, lambda best: loop._restore(best, "none"))

    assert check({"mean_reward": 0.6, "pass@4": 0.95}, artefact) == {"ok": True}
    assert loop.state["best"]["reward"] == 0.6 and "stopped" not in loop.state
    verdict = check({"mean_reward": 0.7, "pass@4": 0.8}, artefact.model_copy(update={"version": "e2"}))
    assert verdict["ok"] is False and verdict["problems"] == ["validation pass@4 0.800 is below the accepted 0.9"]
    assert loop.state["applied"] == loop.state["best"]["artefact"] and loop.state["best"]["reward"] == 0.6
    assert loop.state["stopped"].startswith("validation pass@4 0.800 is below the accepted 0.9")

    plan["guard"]["accept"] = {"pass@k": 0.5}
    path.write_text(yaml.safe_dump(plan))
    with pytest.raises(PlanError, match=r"key 'guard': accept: unknown metric 'pass@k': use mean_reward, pass@K, "
                                        r"reward_components\.NAME"):
        load_plan(path)


def test_keep_last_prunes_old_weights_but_never_the_applied_or_best(tmp_path: Path) -> None:
    import orjson

    from rollgym.train.loop.epochs import TrainLoop
    from rollgym.train.loop.plan import load_plan

    registry = tmp_path / "stack.json"
    registry.write_bytes(orjson.dumps({"agent": {"url": "http://127.0.0.1:9", "role": "agents"}}))
    tasks = str(REPO_ROOT / "resources_servers/weather/data/example.jsonl")
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "output": str(tmp_path / "run"), "stack": {"registry_file": str(registry)}, "checkpoints": {"keep_last": 1},
        "stages": [{"name": "s", "collect": {"input": tasks}, "optimize": {"trainer": "grpo"}, "apply": "none"}]}))
    loop = TrainLoop(load_plan(path), progress=False)
    artefacts = {}
    for epoch in (1, 2, 3, 4):
        train = loop.output / f"epoch-{epoch:03d}" / "train"
        (train / "checkpoint" / "adapter").mkdir(parents=True)
        (train / f"policy-e{epoch:03d}.gguf").write_bytes(b"GGUF")
        artefacts[epoch] = {"uri": str(train / "checkpoint" / "adapter"), "serving_uri": str(train / f"policy-e{epoch:03d}.gguf")}
        (train / "artefact.json").write_bytes(orjson.dumps(artefacts[epoch]))
    (loop.output / "epoch-005" / "train" / "checkpoint").mkdir(parents=True)  # a step still running
    loop.state = {"applied": artefacts[4], "last": artefacts[4], "best": {"reward": 1.0, "artefact": artefacts[2]}}
    loop.prune()
    present = {e: (loop.output / f"epoch-{e:03d}" / "train" / "checkpoint").is_dir() for e in (1, 2, 3, 4, 5)}
    assert present == {1: False, 2: True, 3: False, 4: True, 5: True}
    assert [p.name for p in sorted(loop.output.glob("epoch-*/train/*.gguf"))] == ["policy-e002.gguf", "policy-e004.gguf"]
    assert all((loop.output / f"epoch-{e:03d}" / "train" / "artefact.json").is_file() for e in (1, 2, 3, 4))
    # checkpoints.every keeps every Nth step's weights, to rewind to; rewinding says which are left.
    loop.plan.checkpoints.every = 3
    (loop.output / "epoch-003" / "train" / "checkpoint" / "adapter").mkdir(parents=True)
    (loop.output / "epoch-003" / "train" / "policy-e003.gguf").write_bytes(b"GGUF")
    loop.prune()
    assert (loop.output / "epoch-003" / "train" / "policy-e003.gguf").exists()
    assert (loop.output / "epoch-003" / "train" / "checkpoint" / "adapter").is_dir()
    from rollgym.train.loop.run_folder import RewindError

    (loop.output / "history.jsonl").write_bytes(b"".join(orjson.dumps({"epoch": e}) + b"\n" for e in range(5)))
    for epoch in (1, 2, 3, 4):
        (loop.output / f"epoch-{epoch:03d}" / "state.json").write_bytes(orjson.dumps(
            {"applied": artefacts[epoch], "last": artefacts[epoch], "best": None}))
    with pytest.raises(RewindError, match=r"cannot rewind to epoch 1: its weights .*epoch-001.* are pruned "
                                          r"\(checkpoints.keep_last: 1 keeps the last 1 steps' weights; "
                                          r"checkpoints.every keeps every Nth\); epochs it can rewind to: 2, 3, 4"):
        loop.folder.rewind(1, log=lambda _: None, keep_last=1)
    with pytest.raises(RewindError, match=r"its weights .*epoch-001.* are gone \(removed outside rollgym\)"):
        loop.folder.rewind(1, log=lambda _: None)  # a run without keep_last: the message names no setting


def test_a_rewind_rebuilds_the_merged_gguf_its_epoch_kept_the_weights_of(tmp_path: Path) -> None:
    """apply: merged prunes every GGUF but the applied, last and best ones, while each epoch keeps its adapter:
    rewinding to such an epoch rebuilds its GGUF (and the best one's) from the adapter instead of refusing."""
    import orjson

    from rollgym.train.loop.run_folder import RewindError, RunFolder

    folder = RunFolder(tmp_path / "run", "epoch")
    artefacts = {}
    for epoch in (1, 2, 3, 4):
        train = folder.unit_dir(epoch) / "train"
        (train / "adapter").mkdir(parents=True)
        artefacts[epoch] = {"uri": str(train / "adapter"), "serving_uri": str(train / f"policy-e{epoch:03d}.gguf"),
                            "base_model": "bundled", "version": f"policy-e{epoch:03d}"}
        (train / "artefact.json").write_bytes(orjson.dumps(artefacts[epoch]))
        best = {"reward": 0.5, "artefact": artefacts[2], "version": "policy-e002"} if epoch >= 2 else None
        (folder.unit_dir(epoch) / "state.json").write_bytes(orjson.dumps(
            {"applied": artefacts[epoch], "last": artefacts[epoch], "best": best}))
    Path(artefacts[4]["serving_uri"]).write_bytes(b"GGUF")  # the run's end: only the applied one is left
    folder.history_path.write_bytes(b"".join(orjson.dumps({"epoch": e}) + b"\n" for e in range(5)))
    with pytest.raises(RewindError, match=r"its weights .*policy-e003.gguf are gone"):
        folder.rewind(3, log=lambda _: None)  # no way to rebuild it: refused, naming the file
    rebuilt: list[str] = []

    def rebuild(artefact: dict) -> None:
        rebuilt.append(artefact["version"])
        Path(artefact["serving_uri"]).write_bytes(b"GGUF rebuilt")

    folder.rewind(3, log=lambda _: None, rebuild=rebuild)
    assert rebuilt == ["policy-e003", "policy-e002"]  # the applied (and last) one, then the best one
    state = orjson.loads(folder.state_path.read_bytes())
    assert state["applied"] == artefacts[3] and state["best"]["artefact"] == artefacts[2]
    assert [line["epoch"] for line in folder.history()] == [0, 1, 2, 3]
    assert not folder.unit_dir(4).exists() and list((folder.root / "rewound").glob("after-epoch-003-*/epoch-004"))
