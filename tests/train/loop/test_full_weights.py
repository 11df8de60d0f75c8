"""apply: weights (train/loop/weights.py): a full-weight step is checked, staged where every replica reads it,
and reloaded by every replica of the policy model; what cannot be served is refused before any replica changes.

The replicas are models/chat_completions servers in front of the scripted backend in vLLM's shape (its weight
routes answer as vLLM 0.32's); tests/e2e/test_vllm_weights.py does the same against a real vLLM.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from safetensors.numpy import save_file

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.client import ServerAddress
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread
from rollgym.train.loop.plan import PlanError, load_plan
from rollgym.train.loop.weights import (DiskTransport, FullWeights, WeightsConfig, WeightsRefused, check_tensors,
                                        tensor_shapes)

SERVED = {"model.embed_tokens.weight": (8, 4), "model.layers.0.mlp.up_proj.weight": (6, 4),
          "model.norm.weight": (4,)}


def checkpoint(path: Path, shapes: dict[str, tuple[int, ...]] = SERVED, value: float = 0.0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file({name: np.full(shape, value, dtype=np.float32) for name, shape in shapes.items()},
              str(path / "model.safetensors"))
    return path


def test_tensor_names_and_shapes_come_from_the_headers_and_every_difference_is_named(tmp_path: Path) -> None:
    assert tensor_shapes(checkpoint(tmp_path / "ok")) == SERVED
    served = {**SERVED, "lm_head.weight": (8, 4)}
    check_tensors(SERVED, served, "ok")  # a tied output layer is saved once, with the embeddings
    with pytest.raises(WeightsRefused, match=r"step-3: refused before any replica loaded it: missing tensors: "
                                             r"model\.norm\.weight"):
        check_tensors({k: v for k, v in SERVED.items() if k != "model.norm.weight"}, served, "step-3")
    with pytest.raises(WeightsRefused, match=r"wrong shapes: model\.layers\.0\.mlp\.up_proj\.weight \[6, 5\] "
                                             r"\(served: \[6, 4\]\)"):
        check_tensors({**SERVED, "model.layers.0.mlp.up_proj.weight": (6, 5)}, served, "step-3")
    with pytest.raises(WeightsRefused, match=r"tensors the served model does not have: model\.extra"):
        check_tensors({**SERVED, "model.extra": (1,)}, served, "step-3")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsRefused, match="no \\*.safetensors files"):
        tensor_shapes(tmp_path / "empty")


def test_the_disk_transport_stages_whole_steps_keeps_the_last_ones_and_cleans_up(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    (folder / "policy-s007.partial").mkdir(parents=True)  # a killed run's leftovers
    transport = DiskTransport(folder, keep=2)
    assert not folder.exists()
    staged = [transport.stage(checkpoint(tmp_path / f"c{i}", value=i), f"policy-s00{i}") for i in (1, 2, 3)]
    assert staged == [str(folder / f"policy-s00{i}") for i in (1, 2, 3)]
    assert sorted(p.name for p in folder.iterdir()) == ["policy-s002", "policy-s003"]
    assert tensor_shapes(Path(staged[-1])) == SERVED
    assert (Path(staged[-1]) / "model.safetensors").read_bytes() == (tmp_path / "c3" / "model.safetensors").read_bytes()
    transport.close()
    assert not folder.exists()
    assert DiskTransport(None).stage(tmp_path / "c1", "v") == str((tmp_path / "c1").resolve())  # dir: checkpoint


def test_a_step_reaches_every_replica_a_bad_checkpoint_none_and_a_failed_replica_is_named(tmp_path: Path) -> None:
    reference = checkpoint(tmp_path / "base")
    with ExitStack() as stack:
        backends = [stack.enter_context(scripted_backend("--token-info", *flags)) for flags in ((), ("--fail-reloads", "1"))]
        replicas = [stack.enter_context(serve_in_thread(ChatCompletionsModel(
            ChatCompletionsConfig(base_url=url, model="scripted", max_retries=0), name="policy_model")))
            for url in backends]
        registry = {"policy_model": ServerAddress.replicated(replicas, role="models")}
        full = FullWeights(WeightsConfig(dir=str(tmp_path / "shm")), tmp_path / "run", str(reference), log=lambda m: None)

        with pytest.raises(WeightsRefused, match=r"wrong shapes: model\.norm\.weight \[5\]"):
            full.publish(registry, "policy_model", checkpoint(tmp_path / "bad", {**SERVED, "model.norm.weight": (5,)}),
                         "scripted@policy-s001")
        for url in backends:  # no replica was paused, let alone reloaded
            log = httpx.get(f"{url.removesuffix('/v1')}/scripted/requests").json()["requests"]
            assert not [entry for entry in log if entry["path"] in ("/pause", "/collective_rpc")]

        sync = full.publish(registry, "policy_model", checkpoint(tmp_path / "s1", value=1.0), "scripted@policy-s001")
        assert sync.path == str(tmp_path / "shm" / "policy-s001") and not sync.counted
        assert [replica["url"] for replica in sync.failed] == [replicas[1]] and "HTTP 502" in sync.failed[0]["message"]
        summary = sync.summary()
        assert summary["replicas"] == 2 and set(summary["seconds"]) == {"check", "stage", "reload", "total"}
        assert [httpx.get(f"{url}/v1/models").json()["data"][0]["model_version"] for url in replicas] == \
            ["scripted@policy-s001", "scripted"]

        sync = full.publish(registry, "policy_model", checkpoint(tmp_path / "s2", value=2.0), "scripted@policy-s002")
        assert sync.counted and not sync.failed  # the replica that failed is tried again with the next step
        assert {httpx.get(f"{url}/v1/models").json()["data"][0]["model_version"] for url in replicas} == \
            {"scripted@policy-s002"}
        full.close()
        assert not (tmp_path / "shm").exists()


def plan_data(tmp_path: Path) -> dict:
    weather = REPO_ROOT / "resources_servers/weather"
    return {
        "base_model": str(tmp_path), "output": str(tmp_path / "run"),
        "stack": {"configs": [str(weather / "configs/weather.yaml"),
                              str(REPO_ROOT / "models/chat_completions/configs/chat_completions.yaml")]},
        "stages": [{"name": "grpo", "collect": {"input": str(weather / "data/train.jsonl"), "params": {"temperature": 1.0}},
                    "optimize": {"trainer": "grpo", "args": {"finetune": "full", "temperature": 1.0}},
                    "apply": "weights"}],
    }


def load(tmp_path: Path, data: dict):  # noqa: ANN201 - a Plan
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_plan(path)


def test_plans_that_serve_full_weights_by_reload_check_clean_and_what_cannot_is_refused_by_key(tmp_path: Path) -> None:
    data = plan_data(tmp_path)
    assert load(tmp_path, data).stages[0].apply == "weights"
    data["weights"] = {"dir": str(tmp_path / "w"), "keep": 3}
    assert load(tmp_path, data).weights.keep == 3
    data["stages"][0]["optimize"]["args"]["finetune"] = "lora"
    with pytest.raises(PlanError, match=r"stages\[0\]\.apply: weights reloads full weights on the serving engines; "
                                        r"stages\[0\]\.optimize trains lora"):
        load(tmp_path, data)
    data = plan_data(tmp_path)
    data["stack"]["overrides"] = ["policy_model.backend=openai"]
    with pytest.raises(PlanError, match=r"key 'stages\[0\]\.apply': the stack's policy_model has backend 'openai'"):
        load(tmp_path, data)
    data = plan_data(tmp_path)
    stage = data.pop("stages")[0]
    data.update(mode="async", optimize=stage["optimize"], orchestrator={
        "batch_size": 4, "rollouts_per_example": 2, "max_steps": 2,
        "envs": [{"name": "weather", "input": stage["collect"]["input"], "agent": "weather_agent",
                  "params": stage["collect"]["params"]}]})
    assert load(tmp_path, data).optimize.finetune == "full"  # mode: async serves each step by reload
    data["optimize"]["args"]["checkpoint_every"] = 2
    with pytest.raises(PlanError, match=r"optimize\.args\.checkpoint_every: full weights reloaded by the engines"):
        load(tmp_path, data)
    data["optimize"]["args"]["checkpoint_every"] = 1
    data["weights"] = {"keep": 0}
    with pytest.raises(PlanError, match=r"key 'weights\.keep'"):
        load(tmp_path, data)
