"""Several backends behind one chat_completions server, through the real agent and weather environment:
new sessions spread over the least-loaded backends, a rollout's turns stick to one backend, and when
a backend is killed mid-run no rollout is lost: its sessions move to the others, token-exact.

The backends are scripts/scripted_backend.py subprocesses (vLLM shapes, 300 ms per generation so
that rollouts are in flight when one backend dies). Which backend served a turn is read from the
generated items' ids, whose last 4 hex digits are the serving backend's tag (routing.py).
"""

from __future__ import annotations

import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from models.chat_completions.routing import url_tag
from resources_servers.weather.app import WeatherServer
from rollgym import ServerAddress
from rollgym.schema import RunResponse
from rollgym.testing import SCRIPTED_BACKEND_COMMAND, serve_in_thread

TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False}
CITIES = [("Paris", "sunny"), ("London", "rainy"), ("Tokyo", "cloudy")]


def start_backend(tmp: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"port-{time.monotonic_ns()}"
    process = subprocess.Popen([*SCRIPTED_BACKEND_COMMAND, "--port", "0", "--port-file", str(port_file), *flags],
                               stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not port_file.exists():
        assert process.poll() is None and time.monotonic() < deadline, "scripted backend did not start"
        time.sleep(0.02)
    return process, f"http://127.0.0.1:{int(port_file.read_text())}/v1"


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
    process.wait(timeout=10)


@pytest.fixture
def three_backends() -> Iterator[list[tuple[subprocess.Popen, str]]]:
    with tempfile.TemporaryDirectory() as tmp:
        backends = [start_backend(Path(tmp), "--latency-ms", "300") for _ in range(3)]
        try:
            yield backends
        finally:
            for process, _ in backends:
                stop(process)


def row(index: int) -> dict:
    city, condition = CITIES[index % len(CITIES)]
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [TOOL]},
            "city": city, "expected": [condition], "rollout_id": f"r{index}"}


def tags(rollout: dict) -> list[str]:
    """The serving backend's tag of each model call, in order (from the items that carry tokens)."""
    return [item["id"][-4:] for item in rollout["response"]["output"] if item.get("generation_token_ids")]


def test_sticky_sessions_least_loaded_and_a_backend_killed_mid_run(three_backends) -> None:
    urls = [url for _, url in three_backends]
    killed_process, killed_url = three_backends[0]
    killed = url_tag(killed_url)
    model = ChatCompletionsModel(ChatCompletionsConfig(
        base_url=urls, model="scripted", return_token_ids=True, backend_cooldown_s=60, max_retries=1,
        timeout_s=20), name="policy_model")
    with ExitStack() as stack:
        model_url = stack.enter_context(serve_in_thread(model))
        weather_url = stack.enter_context(serve_in_thread(WeatherServer(name="weather")))
        agent = SimpleAgent(
            SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"}),
            name="agent", registry={"policy_model": ServerAddress(url=model_url, role="models"),
                                    "weather": ServerAddress(url=weather_url, role="resources_servers")})
        agent_url = stack.enter_context(serve_in_thread(agent))
        http = stack.enter_context(httpx.Client(timeout=60.0))
        pool = stack.enter_context(ThreadPoolExecutor(max_workers=12))
        futures = [pool.submit(http.post, f"{agent_url}/run", json=row(i)) for i in range(12)]
        # Kill the first backend once one of its sessions is in its second turn (tokenizing for it).
        log_url = killed_url.removesuffix("/v1") + "/scripted/requests"
        deadline = time.monotonic() + 20
        while not any(e["path"] == "/tokenize" for e in http.get(log_url).json()["requests"]):
            assert time.monotonic() < deadline, "no session reached its second turn on the first backend"
            time.sleep(0.01)
        killed_process.send_signal(signal.SIGKILL)
        replies = [future.result() for future in futures]
        status = http.get(f"{model_url}/backends").json()["backends"]

    rollouts = [reply.json() for reply in replies]
    assert [reply.status_code for reply in replies] == [200] * 12
    for rollout in rollouts:
        RunResponse.model_validate(rollout)
        assert rollout["status"] == "ok" and rollout["reward"] == 1.0, rollout.get("error")  # no rollout lost
        # Token-exact even across the move: one sequence, every prompt extends the previous tokens.
        assert rollout["prefix_ok"] is True and len(rollout["sequences"]) == 1
    served = [tags(rollout) for rollout in rollouts]
    assert all(len(t) == 2 for t in served)
    # New sessions went to every backend (least loaded first).
    assert {t[0] for t in served} == {url_tag(url) for url in urls}
    # Sessions on surviving backends stuck to them; sessions on the killed one moved.
    moved = [t for t in served if t[0] == killed]
    assert moved and all(t[1] != killed for t in moved)
    assert all(t[0] == t[1] for t in served if t[0] != killed)
    # The killed backend is out (cooling down) and was counted as failing.
    by_url = {entry["url"]: entry for entry in status}
    assert by_url[killed_url]["up"] is False and by_url[killed_url]["failures"] >= 1
