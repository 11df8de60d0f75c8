"""Token checks on the real embedded model (llama.cpp + SmolLM2-135M on CPU): real token ids, no mocks.

Skipped when llama-cpp-python or the bundled weights are not installed. The servers run in-process
(rollgym.testing.serve_in_thread); the check is rollgym check-tokens' own TokenChecker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

pytest.importorskip("llama_cpp", reason="the embedded model needs llama-cpp-python (make install builds it)")
try:
    from models.llamacpp.engine import bundled_model_path

    bundled_model_path()
except Exception as exc:  # noqa: BLE001 - any reason the weights are missing
    pytest.skip(f"the bundled SmolLM2 weights are not installed: {exc}", allow_module_level=True)

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig  # noqa: E402
from models.llamacpp.app import LlamaCppConfig, LlamaCppModel  # noqa: E402
from resources_servers.weather.app import WeatherServer  # noqa: E402
from rollgym import ServerAddress, ServerClient  # noqa: E402
from rollgym.testing import REPO_ROOT  # noqa: E402
from rollgym.testing import serve_in_thread  # noqa: E402
from rollgym.envkit.token_check import Report, TokenChecker, format_report, prepare_task  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, ServerAddress]]:
    with ExitStack() as stack:
        model_url = stack.enter_context(serve_in_thread(LlamaCppModel(LlamaCppConfig(n_ctx=2048), name="policy_model"),
                                                        timeout_s=120))
        weather_url = stack.enter_context(serve_in_thread(WeatherServer(name="weather")))
        registry = {"policy_model": ServerAddress(url=model_url, role="models"),
                    "weather": ServerAddress(url=weather_url, role="resources_servers")}
        agent = SimpleAgent(SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"}),
                            name="agent", registry=registry)
        agent_url = stack.enter_context(serve_in_thread(agent))
        yield {**registry, "agent": ServerAddress(url=agent_url, role="agents")}


def test_tokenize_and_detokenize_on_the_real_tokenizer(servers) -> None:
    url = servers["policy_model"].url
    text = "The weather in Paris"
    tokens = httpx.post(f"{url}/tokenize", json={"text": text}).json()["tokens"]
    decoded = httpx.post(f"{url}/detokenize", json={"tokens": tokens, "pieces": True}).json()
    assert decoded["text"] == text and "".join(decoded["pieces"]) == text and len(tokens) < len(text)
    conversation = [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "content": "hello"}]
    closed = httpx.post(f"{url}/tokenize", json={"input": conversation, "add_generation_prompt": False}).json()["tokens"]
    opened = httpx.post(f"{url}/tokenize", json={"input": conversation}).json()["tokens"]
    assert opened[: len(closed)] == closed and len(opened) > len(closed)
    assert httpx.post(f"{url}/detokenize", json={"tokens": "x"}).json()["error"]["field"] == "tokens"


def test_check_tokens_passes_on_the_embedded_model(servers) -> None:
    row = json.loads((REPO_ROOT / "resources_servers/weather/data/example.jsonl").read_text().splitlines()[0])
    task = prepare_task(row, force_tool=True, max_output_tokens=48, index=0)
    task["responses_create_params"]["temperature"] = 0.0

    async def check() -> list:
        client = ServerClient(servers, timeout_s=300)
        try:
            return await TokenChecker(client, "agent", "policy_model").run([task], 300)
        finally:
            await client.close()

    report = Report(agent="agent", model_server="policy_model", input="weather", forced_tool=True,
                    rollouts=asyncio.run(check()))
    text = format_report(report)
    assert report.ok(), text
    [rollout] = report.rollouts
    assert len(rollout.turns) >= 2 and all(turn.extends for turn in rollout.turns[1:]), text
    assert rollout.prefix_ok is True and rollout.sequences == 1
    assert rollout.retokenize_same is not None  # the re-render comparison ran (its verdict depends on sampling)
