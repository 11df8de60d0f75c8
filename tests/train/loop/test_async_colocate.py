"""`rollgym train` with `mode: async` and `colocate: true`: full-weight GRPO on the bundled SmolLM2-135M, the
transformers server and the trainer in one process, the orchestrator generating a step ahead on reverse_text.
Each optimizer step is published in memory as a new model_version (no weight file but its checkpoint), and
every rollout's model_version maps to the step that sampled it, so the staleness accounting is exact.

Two steps of one group of 2 rollouts of at most 6 tokens.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

pytest.importorskip("torch", reason="the co-located server needs torch")
pytest.importorskip("transformers", reason="the co-located server needs transformers")

from rollgym.testing import REPO_ROOT  # noqa: E402
from rollgym.train.loop.async_driver import AsyncTrainLoop  # noqa: E402
from rollgym.train.loop.plan import load_plan  # noqa: E402

try:
    from rollgym.train.trainers.policy import bundled_gguf

    bundled_gguf()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = pytest.mark.slow

ENV = REPO_ROOT / "resources_servers" / "reverse_text"


def lines(path: Path) -> list[dict]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_async_full_weights_colocated_publish_each_step_in_memory_with_exact_versions(tmp_path: Path) -> None:
    tasks = (ENV / "data" / "train.jsonl").read_bytes().splitlines()
    (tmp_path / "validation.jsonl").write_bytes(b"\n".join(tasks[-2:]) + b"\n")
    sampling = {"temperature": 1.0, "max_output_tokens": 6}
    plan = {
        "base_model": "bundled", "output": str(tmp_path / "run"), "mode": "async", "colocate": True, "seed": 3,
        "stack": {"configs": [str(ENV / "configs" / "reverse_text.yaml")],
                  "overrides": ["policy_model.n_ctx=256", "policy_model.max_batch=4", "policy_model.train_tokens=512",
                               "policy_model.threads=1", "policy_model.kv_tokens=1024"]},
        "validation": {"input": str(tmp_path / "validation.jsonl"), "every": 2, "repeats": 1, "params": sampling},
        "orchestrator": {"batch_size": 2, "rollouts_per_example": 2, "max_steps": 2, "max_async_level": 1,
                         "max_off_policy_steps": 1, "concurrency": 4,
                         "envs": [{"name": "reverse", "input": str(ENV / "data" / "train.jsonl"),
                                   "agent": "reverse_text_agent", "params": sampling}]},
        "optimize": {"trainer": "grpo", "args": {"finetune": "full", "learning_rate": 1e-5, "threads": 1,
                                                 "micro_batch_tokens": 512}},
    }
    path = tmp_path / "plan.json"
    path.write_bytes(orjson.dumps(plan))
    AsyncTrainLoop(load_plan(path), progress=False, log=lambda _: None).run()
    run = tmp_path / "run"
    history = lines(run / "history.jsonl")
    assert [line["step"] for line in history] == [0, 1, 2]
    base = next(r["response"]["model_version"] for r in lines(run / "step-000" / "validation.jsonl"))
    published = {0: base, 1: f"{base}@policy-s001", 2: f"{base}@policy-s002"}
    # Each step is served as soon as it returns, under its own version, published in memory.
    assert [line["model_version"] for line in history[1:]] == [published[1], published[2]]
    assert {r["response"]["model_version"] for r in lines(run / "step-002" / "validation.jsonl")} == {published[2]}
    # Every rollout's model_version is the step that sampled it: the orchestrator's lag is exact.
    for step in (1, 2):
        batch = lines(run / "orchestrator" / "steps" / f"step_{step}" / "batch.jsonl")
        assert len(batch) == 2
        for rollout in batch:
            versions = {item["model_version"] for item in rollout["response"]["output"] if item.get("model_version")}
            assert versions == {published[rollout["sampled_step"]]}, (versions, rollout["sampled_step"])
            assert rollout["policy_lag"] == step - 1 - rollout["sampled_step"] <= 1
        assert sum(history[step]["orchestrator"]["staleness"].values()) == 2
    # Step 1 trains the very weights that sampled its batch: on-policy, the behaviour ratio is 1.
    first = history[1]["train"]
    assert abs(first["importance_ratio_mean"] - 1) < 1e-3
    assert 0.99 < first["importance_ratio_min"] <= first["importance_ratio_max"] < 1.01
    # No weight file but the steps' checkpoints (what a resumed run starts from).
    weights = [p.relative_to(run).parts for p in run.rglob("*") if p.suffix in (".safetensors", ".gguf", ".bin")]
    assert weights and {parts[:3] for parts in weights} == {(f"step-00{n}", "train", "checkpoint") for n in (1, 2)}
