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
    from rollgym.train.loop import TrainLoop
    from rollgym.train.plan import load_plan
    from rollgym.train.policy import bundled_gguf

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
        "validation": {"input": tasks, "limit": 3, "repeats": 1, "params": greedy},
        "stages": [{"name": "toy", "epochs": 3, "collect": {"input": tasks, "limit": 1, "repeats": 1, "params": greedy},
                    "optimize": {"adapter": "tests.train.toy_trainers:GgufTrainer", "data": "sft"}, "apply": "merged"}],
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
