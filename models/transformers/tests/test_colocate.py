"""Co-locate mode: the transformers server and the GRPO trainer in one process over real HTTP, on the bundled
SmolLM2-135M (fp32 on CPU). A full-weight step trains the served tensors themselves (same storage), and the
first generation after it samples from the new weights under the new model_version.

One model load; generations are a few tokens, the step one small group.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest

torch = pytest.importorskip("torch", reason="the transformers model server needs torch")
pytest.importorskip("transformers", reason="the transformers model server needs transformers")
try:
    from rollgym.train.trainers.policy import bundled_gguf

    bundled_gguf()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

from rollgym.adapters import listed_version  # noqa: E402
from rollgym.client import ServerAddress  # noqa: E402
from rollgym.testing import serve_in_thread  # noqa: E402
from rollgym.train.loop.colocate import ColocatedTrainer, publish  # noqa: E402
from rollgym.train.trainers.base import TrainConfig  # noqa: E402

from models.transformers.colocate import ColocateConfig, ColocatedModel  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Name a colour."}]


def respond(client: httpx.Client, seed: int) -> dict[str, Any]:
    reply = client.post("/v1/responses", json={"input": PROMPT, "max_output_tokens": 6, "temperature": 1.0,
                                               "seed": seed})
    assert reply.status_code == 200, reply.text
    return next(item for item in reply.json()["output"] if item.get("generation_token_ids") is not None)


def member(item: dict[str, Any], advantage: float, number: int) -> dict[str, Any]:
    completion = item["generation_token_ids"]
    return {"rollout_id": number, "advantage": advantage, "sampling": item["sampling"],
            "sequence": {"prompt_ids": item["prompt_token_ids"], "completion_ids": completion,
                         "completion_mask": [1] * len(completion), "completion_logprobs": item["generation_log_probs"]}}


@torch.inference_mode()
def forward_logprobs(model: Any, prompt: list[int], generation: list[int]) -> list[float]:
    """log softmax(logits) of `generation` after `prompt` (T = 1), one forward pass of `model`."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt + generation], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(generation, device=device)[:, None])[:, 0].tolist()


def test_a_step_trains_the_served_tensors_and_the_next_generation_samples_from_them(tmp_path: Path) -> None:
    server = ColocatedModel(ColocateConfig(n_ctx=512, max_batch=4), name="policy_model")
    with serve_in_thread(server, timeout_s=300) as url, httpx.Client(base_url=url, timeout=300) as client:
        health = client.get("/health").json()
        split = health["colocate"]
        assert split["trainer_bytes"] > 12 * 134_000_000 and 0 < split["kv_tokens"] <= 4 * 512, split
        base_version = client.get("/v1/models").json()["data"][0]["model_version"]
        items = [respond(client, seed) for seed in (1, 2, 3, 4)]
        assert all(item["model_version"] == base_version for item in items)
        served = server.engine.model
        before = {name: p.detach().clone() for name, p in served.named_parameters() if "layers.29." in name}
        probe = {"prompt_token_ids": items[0]["prompt_token_ids"], "completion_token_ids": items[0]["generation_token_ids"]}
        scored_before = client.post("/v1/score", json=probe).json()["logprobs"]
        dataset = tmp_path / "curated.jsonl"
        group = {"rollouts": [member(item, advantage, n) for n, (item, advantage)
                              in enumerate(zip(items, (1.0, -1.0, 1.0, -1.0)))]}
        dataset.write_bytes(orjson.dumps(group) + b"\n")
        config = {"base_model": "bundled", "output_dir": str(tmp_path / "train"), "version": "policy-e001",
                  "seed": 0, "args": {"finetune": "full", "learning_rate": 1e-4, "threads": 2}}
        # As the loop hands it over (loop/colocate.py): the step runs in the server, apply: memory finds it served.
        registry = {"policy_model": ServerAddress(url=url, role="models")}
        job = ColocatedTrainer(SimpleNamespace(registry=registry)).submit(dataset, TrainConfig.model_validate(config))
        artefact = job.wait(timeout=600)
        assert job.status() == "succeeded" and artefact.kind == "full_weights" and artefact.version == "policy-e001"
        step = {"model_version": f"{base_version}@policy-e001"}
        assert publish(registry, artefact, asyncio.run(listed_version(registry, "policy_model", None))) == \
            step["model_version"]
        assert (tmp_path / "train" / "checkpoint" / "model").is_dir()  # the resume point, not what serves
        # The trainer trains the served tensors: same storage, and they moved.
        trained = dict(server.trainer.model.named_parameters())
        assert trained and all(p.data_ptr() == trained[name].data_ptr() for name, p in served.named_parameters())
        assert any(not torch.equal(before[name], trained[name]) for name in before)
        # The first generation after the step: the new version, sampled from the new weights.
        after = respond(client, 5)
        assert after["model_version"] == step["model_version"]
        assert client.get("/v1/models").json()["data"][0]["model_version"] == step["model_version"]
        new = forward_logprobs(server.trainer.model, after["prompt_token_ids"], after["generation_token_ids"])
        sampled = after["generation_log_probs"]
        assert max(abs(a - b) for a, b in zip(sampled, new)) < 2e-3, (sampled, new)
        scored_after = client.post("/v1/score", json=probe).json()["logprobs"]  # the step moved the distribution
        assert max(abs(a - b) for a, b in zip(scored_before, scored_after)) > 1e-3
        # A bad step request names its field; the server serves on.
        bad = client.post("/colocate/train_step", json={"dataset": str(tmp_path / "none.jsonl"), "config": config})
        assert bad.status_code == 404 and "dataset" in bad.text
        # A resumed run applies the step's checkpoint to a server that serves other weights: copied in place.
        with torch.no_grad():
            served.model.layers[29].mlp.down_proj.weight.add_(0.01)
        assert publish(registry, artefact, base_version) == step["model_version"]
        assert respond(client, 5)["generation_log_probs"] == pytest.approx(sampled, abs=2e-3)



def test_a_lora_step_is_served_again_from_its_checkpoint_by_a_fresh_server(tmp_path: Path) -> None:
    """A LoRA co-located run resumes: a fresh server (the stack started again) serves the step's adapter from its
    checkpoint under the step's version, sampling what the server that trained it sampled; the next step trains
    on from it (the adapter unwrapped, wrapped again with the trainer's state)."""
    def serve() -> Any:
        return ColocatedModel(ColocateConfig(n_ctx=512, max_batch=4, finetune="lora", threads=1,
                                             train_tokens=512, kv_tokens=2048), name="policy_model")

    config = {"base_model": "bundled", "output_dir": str(tmp_path / "train"), "version": "policy-e001", "seed": 0,
              "args": {"finetune": "lora", "learning_rate": 2e-2, "threads": 1, "lora": {"r": 4, "alpha": 8}}}
    with serve_in_thread(serve(), timeout_s=300) as url, httpx.Client(base_url=url, timeout=300) as client:
        base_version = client.get("/v1/models").json()["data"][0]["model_version"]
        items = [respond(client, seed) for seed in (1, 2, 3, 4)]
        dataset = tmp_path / "curated.jsonl"
        group = {"rollouts": [member(item, advantage, n) for n, (item, advantage)
                              in enumerate(zip(items, (1.0, -1.0, 1.0, -1.0)))]}
        dataset.write_bytes(orjson.dumps(group) + b"\n")
        registry = {"policy_model": ServerAddress(url=url, role="models")}
        artefact = ColocatedTrainer(SimpleNamespace(registry=registry)).submit(
            dataset, TrainConfig.model_validate(config)).wait(timeout=600)
        assert artefact.kind == "lora" and Path(artefact.uri, "adapter_config.json").is_file()
        trained = respond(client, 7)
        assert trained["model_version"] == f"{base_version}@policy-e001"
    server = serve()
    with serve_in_thread(server, timeout_s=300) as url, httpx.Client(base_url=url, timeout=300) as client:
        registry = {"policy_model": ServerAddress(url=url, role="models")}
        assert respond(client, 7)["generation_log_probs"] != pytest.approx(trained["generation_log_probs"], abs=1e-3)
        assert publish(registry, artefact, base_version) == trained["model_version"]
        again = respond(client, 7)
        assert again["model_version"] == trained["model_version"]
        assert again["generation_token_ids"] == trained["generation_token_ids"]
        assert again["generation_log_probs"] == pytest.approx(trained["generation_log_probs"], abs=1e-4)
        refused = client.post("/colocate/load_adapter", json={"adapter_path": str(tmp_path), "version": "x"})
        assert refused.status_code == 404 and "adapter_path" in refused.text
        # The next step trains on from the served adapter: one adapter, no second wrapping.
        step = {**config, "output_dir": str(tmp_path / "train2"), "version": "policy-e002", "init_adapter": artefact.uri}
        ColocatedTrainer(SimpleNamespace(registry=registry)).submit(dataset, TrainConfig.model_validate(step)).wait(600)
        assert respond(client, 8)["model_version"] == f"{base_version}@policy-e002"
        from peft.tuners.tuners_utils import BaseTunerLayer

        layers = [m for m in server.engine.model.modules() if isinstance(m, BaseTunerLayer)]
        assert layers and all(len(m.active_adapters) == 1 for m in layers)
        assert not any(isinstance(m.base_layer, BaseTunerLayer) for m in layers)
