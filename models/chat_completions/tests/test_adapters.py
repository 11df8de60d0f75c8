"""chat_completions publishes LoRA adapters to every backend of its pool (vLLM's and SGLang's routes).

The backends are the scripted backend (rollgym.testing.scripted_vllm, a subprocess); loading an adapter
there makes its answers start with `[NAME] `, so each generation shows which weights answered.
Route shapes checked against the backends' source: vLLM vllm/entrypoints/openai/serving_models.py
(`LoadLoRAAdapterRequest{lora_name, lora_path, load_inplace}`, 400 for a name already loaded, 404
for an unknown one on unload), SGLang python/sglang/srt/entrypoints/http_server.py
(`/load_lora_adapter`, `/unload_lora_adapter` at the root, `{success, error_message, loaded_adapters}`).
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import httpx

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.reverse_text.app import ReverseTextServer
from rollgym.adapters import content_digest
from rollgym.client import ServerAddress
from rollgym.testing import free_port, scripted_backend, serve_in_thread

REVERSE = {"responses_create_params": {"input": [{"role": "user", "content": "Reverse this text: bridge"}]},
           "text": "bridge"}


@contextmanager
def pool(*flag_sets: tuple[str, ...], extra_urls: tuple[str, ...] = (), **config: Any) -> Iterator[tuple[httpx.Client, list[str]]]:
    """A chat_completions model server in front of one scripted backend per flag set (+ `extra_urls`)."""
    with ExitStack() as stack:
        urls = [stack.enter_context(scripted_backend(*flags)) for flags in flag_sets]
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=[*urls, *extra_urls], model="scripted",
                                                           return_token_ids=True, max_retries=0, **config),
                                     name="policy_model")
        url = stack.enter_context(serve_in_thread(model))
        yield stack.enter_context(httpx.Client(base_url=url, timeout=60)), urls


def answer_text(response: dict[str, Any]) -> str:
    return response["output"][-1]["content"][0]["text"]


def test_load_forwards_to_every_vllm_backend_and_selects_by_name(tmp_path: Path) -> None:
    with pool(("--token-info",), ("--token-info",)) as (client, backends):
        base = client.post("/v1/responses", json={"input": "Reverse this text: bridge"}).json()
        assert base["model_version"] == "scripted" and answer_text(base) == "egdirb"

        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "step-1", "lora_path": str(tmp_path)})
        assert loaded.status_code == 200, loaded.text
        report = loaded.json()
        step_1 = f"step-1@{content_digest(str(tmp_path))}"
        assert report["model_version"] == step_1 and report["policy"] == step_1
        assert [(b["base_url"], b["ok"], b["status"]) for b in report["backends"]] == [(u, True, 200) for u in backends]
        for url in backends:
            assert "step-1" in [m["id"] for m in httpx.get(f"{url}/models").json()["data"]]
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["scripted", "step-1"]

        for _ in range(2):  # new sessions go to either backend: both serve the adapter
            tuned = client.post("/v1/responses", json={"input": "Reverse this text: bridge"}).json()
            assert answer_text(tuned) == "[step-1] egdirb" and tuned["model"] == "step-1"
            assert {item["model_version"] for item in tuned["output"]} == {step_1}
        by_base_name = client.post("/v1/responses", json={"input": "Reverse this text: bridge", "model": "scripted"})
        assert answer_text(by_base_name.json()) == "egdirb"
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["choices"][0]["message"]["content"] == "[step-1] You said: hi"

        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "step-1"})
        assert unloaded.status_code == 200 and all(b["ok"] for b in unloaded.json()["backends"])
        back = client.post("/v1/responses", json={"input": "Reverse this text: bridge"}).json()
        assert answer_text(back) == "egdirb" and back["model_version"] == "scripted"


def test_sglang_routes_and_model_syntax(tmp_path: Path) -> None:
    with pool(("--token-info", "--shape", "sglang"), backend="sglang") as (client, _):
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "sft", "lora_path": str(tmp_path)})
        assert loaded.status_code == 200, loaded.text
        assert answer_text(client.post("/v1/responses", json={"input": "Reverse this text: abc"}).json()) == "[sft] cba"
        again = client.post("/v1/load_lora_adapter",
                            json={"lora_name": "sft", "lora_path": str(tmp_path), "load_inplace": True})
        first = loaded.json()["model_version"]
        assert again.status_code == 200 and again.json()["model_version"] == first  # the same files: the same version
        (tmp_path / "adapter_model.safetensors").write_bytes(b"new weights")
        changed = client.post("/v1/load_lora_adapter",
                              json={"lora_name": "sft", "lora_path": str(tmp_path), "load_inplace": True})
        assert changed.status_code == 200 and changed.json()["model_version"] not in (first, "sft@2")
        assert changed.json()["model_version"] == f"sft@{content_digest(str(tmp_path))}"
        missing = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path / "no")})
        assert missing.status_code == 400 and "No adapter found" in missing.text


def test_failed_loads_leave_every_backend_as_it_was(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pool(("--token-info",), extra_urls=(dead,)) as (client, (alive,)):
        missing = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path / "nope")})
        assert missing.status_code == 404 and "No adapter found" in missing.text
        # One backend down: the load fails as a whole and the backend that took it drops it again.
        partial = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
        assert partial.status_code == 502 and dead in partial.text, partial.text
        assert [m["id"] for m in httpx.get(f"{alive}/models").json()["data"]] == ["scripted"]
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["scripted"]
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 404
        assert client.post("/v1/load_lora_adapter", json={"lora_name": "a"}).status_code == 400


def test_openai_backend_cannot_load_and_auth_guards_the_routes(tmp_path: Path) -> None:
    with pool(("--token-info",), backend="openai") as (client, _):
        refused = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(tmp_path)})
        assert refused.status_code == 404 and "no runtime LoRA loading" in refused.text
    with pool(("--token-info",), host="0.0.0.0", auth_token="s3cret") as (client, _):
        body = {"lora_name": "a", "lora_path": str(tmp_path)}
        assert client.post("/v1/load_lora_adapter", json=body).status_code == 401
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 401
        authorized = client.post("/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer s3cret"})
        assert authorized.status_code == 200


def test_load_while_32_rollouts_are_in_flight(tmp_path: Path) -> None:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info", "--latency-ms", "1000"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        env_url = stack.enter_context(serve_in_thread(ReverseTextServer(name="reverse_text")))
        agent = SimpleAgent(SimpleAgentConfig(model_server={"name": "policy_model"},
                                              resources_server={"name": "reverse_text"}), name="agent",
                            registry={"policy_model": ServerAddress(url=model_url, role="models"),
                                      "reverse_text": ServerAddress(url=env_url, role="resources_servers")})
        agent_url = stack.enter_context(serve_in_thread(agent))

        async def scenario() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=60) as http:
                runs = [asyncio.create_task(http.post(f"{agent_url}/run", json=REVERSE)) for _ in range(16)]
                log = backend.removesuffix("/v1") + "/scripted/requests"
                while len((await http.get(log)).json()["requests"]) < 16:  # all 16 are at the backend now
                    await asyncio.sleep(0.02)
                loaded = await http.post(f"{model_url}/v1/load_lora_adapter",
                                         json={"lora_name": "hot", "lora_path": str(tmp_path)})
                assert loaded.status_code == 200, loaded.text
                runs += [asyncio.create_task(http.post(f"{agent_url}/run", json=REVERSE)) for _ in range(16)]
                return [reply.json() for reply in await asyncio.gather(*runs)]

        results = asyncio.run(scenario())
    assert [r["status"] for r in results] == ["ok"] * 32
    versions = [r["response"]["output"][-1]["model_version"] for r in results]
    hot = f"hot@{content_digest(str(tmp_path))}"
    assert versions == ["scripted"] * 16 + [hot] * 16
    for result, version in zip(results, versions):  # each item's version is the weights that sampled it
        text = answer_text(result["response"])
        assert text == ("[hot] egdirb" if version == hot else "egdirb"), (version, text)
        assert result["sequences"][0]["model_versions"] == [version]
        assert isinstance(result["reward"], float)


def test_full_weights_reload_on_every_sglang_backend_and_name_the_version(tmp_path: Path) -> None:
    """SGLang's /update_weights_from_disk, forwarded to each backend; answers then report the new version."""
    weights = tmp_path / "step-3" / "model"
    weights.mkdir(parents=True)
    with pool(("--token-info", "--shape", "sglang"), ("--token-info", "--shape", "sglang"),
              backend="sglang") as (client, backends):
        before = client.post("/v1/responses", json={"input": "Reverse this text: bridge"}).json()
        reply = client.post("/update_weights_from_disk", json={"model_path": str(weights), "weight_version": "full-s3"})
        assert reply.status_code == 200, reply.text
        assert [(b["base_url"], b["ok"]) for b in reply.json()["backends"]] == [(u, True) for u in backends]
        for _ in range(2):  # either backend: both reloaded
            after = client.post("/v1/responses", json={"input": "Reverse this text: bridge"}).json()
            assert after["model_version"] == "full-s3" != before["model_version"]
        missing = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nope")})
        assert missing.status_code == 400 and "no model at" in missing.text and "backends[" in missing.text
        assert client.post("/update_weights_from_disk", json={}).status_code == 422  # the field at fault
