"""One embedded model (llama.cpp + SmolLM2-135M on CPU) and one weather environment, shared by the
example agents' tests; each example runs unchanged as a command under the proxy agent."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, Callable, Iterator

import httpx
import pytest

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.testing import serve_in_thread


@pytest.fixture(scope="session")
def embedded_registry() -> Iterator[dict[str, ServerAddress]]:
    pytest.importorskip("llama_cpp", reason="the embedded model needs llama-cpp-python (make install builds it)")
    from models.llamacpp.app import LlamaCppConfig, LlamaCppModel

    with ExitStack() as stack:
        model = LlamaCppModel(LlamaCppConfig(n_ctx=2048), name="policy_model")
        yield {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model, timeout_s=120)), "models"),
               "weather": ServerAddress(stack.enter_context(serve_in_thread(WeatherServer(name="weather"))),
                                        "resources_servers")}


@pytest.fixture
def run_example(embedded_registry: dict[str, ServerAddress]) -> Callable[[str, str], dict[str, Any]]:
    """Runs one weather row through the proxy with `examples/<name>/agent.py` as the agent."""

    def run(name: str, city: str) -> dict[str, Any]:
        config = ProxyAgentConfig(
            model_server={"name": "policy_model"}, resources_server={"name": "weather"}, timeout_s=240,
            agent={"kind": "command", "argv": ["python", f"agents/proxy_agent/examples/{name}/agent.py"]})
        row = {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}]},
               "city": city, "expected": ["sunny", "22"]}
        with serve_in_thread(ProxyAgent(config, name="proxy_agent", registry=embedded_registry)) as url:
            reply = httpx.post(f"{url}/run", json=row, timeout=300)
        assert reply.status_code == 200, reply.text
        return reply.json()

    return run


def check_token_exact(result: dict[str, Any], model_url: str) -> None:
    """The rollout is verified, its calls form one token chain, and the ids the trainer gets are the
    ones behind the text the agent read (the model server's own detokenizer says so)."""
    assert result["status"] in ("ok", "truncated"), result.get("error")
    assert isinstance(result["reward"], float)
    assert result["prefix_ok"] is True and len(result["sequences"]) == 1
    records = [item for item in result["response"]["output"] if item.get("generation_token_ids")]
    assert len(records) == result["metrics"]["turns"] >= 1
    sequence = result["sequences"][0]
    sampled = [t for t, m in zip(sequence["completion_ids"], sequence["completion_mask"]) if m]
    assert sampled == [t for item in records for t in item["generation_token_ids"]]
    last = records[-1]
    if last["type"] == "message" and result.get("agent_answer"):
        text = httpx.post(f"{model_url}/detokenize", json={"tokens": last["generation_token_ids"]}).json()["text"]
        assert result["agent_answer"].strip() in text
