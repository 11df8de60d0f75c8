"""Tests of simple_agent over real HTTP: scripted backend → chat_completions model, weather environment, agent.

Every server runs in-process on a loopback port (rollgym.testing.serve_in_thread); the only stand-in
is scripts/scripted_backend.py, a vLLM-shaped Chat Completions backend run as a subprocess. The
model-mistake tests use a tiny ModelServer written here, served over HTTP like any other.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WeatherServer
from rollgym import ModelServer, ResponsesCreateParams, ServerAddress, build_response
from rollgym.schema import ModelResponse, RunResponse
from rollgym.testing import free_port, scripted_backend, serve_in_thread

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": False,
}
SYSTEM = "You are a weather assistant. Use the get_weather tool, then answer with the condition and the temperature."


def weather_row(city: str = "Paris", expected: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """A task row shaped like resources_servers/weather/data/example.jsonl."""
    return {
        "responses_create_params": {
            "input": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is the weather in {city}?"}],
            "tools": [WEATHER_TOOL],
        },
        "city": city,
        "expected": expected if expected is not None else ["sunny", "22"],
        **extra,
    }


def make_model(backend_url: str, **config: Any) -> ChatCompletionsModel:
    return ChatCompletionsModel(ChatCompletionsConfig(base_url=backend_url, model="scripted", **config), name="policy_model")


def make_agent(model_url: str, weather_url: str, **config: Any) -> SimpleAgent:
    return SimpleAgent(
        SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"}, **config),
        name="agent",
        registry={
            "policy_model": ServerAddress(url=model_url, role="models"),
            "weather": ServerAddress(url=weather_url, role="resources_servers"),
        },
    )


@contextmanager
def agent_client(model_url: str, weather_url: str, **config: Any) -> Iterator[httpx.Client]:
    with serve_in_thread(make_agent(model_url, weather_url, **config)) as url:
        with httpx.Client(base_url=url, timeout=15.0) as http:
            yield http


def run(client: httpx.Client, row: dict[str, Any], status_code: int = 200) -> dict[str, Any]:
    reply = client.post("/run", json=row)
    assert reply.status_code == status_code, reply.text
    return reply.json()


def message_text(item: dict[str, Any]) -> str:
    assert item["type"] == "message" and item["role"] == "assistant", item
    return "".join(part.get("text", "") for part in item["content"])


# --- the stacks -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def weather_url() -> Iterator[str]:
    with serve_in_thread(WeatherServer(name="weather")) as url:
        yield url


@pytest.fixture(scope="module")
def model_url() -> Iterator[str]:
    with scripted_backend() as backend:
        with serve_in_thread(make_model(backend)) as url:
            yield url


@pytest.fixture(scope="module")
def agent(model_url: str, weather_url: str) -> Iterator[httpx.Client]:
    with agent_client(model_url, weather_url) as http:
        yield http


@pytest.fixture(scope="module")
def token_agent(weather_url: str) -> Iterator[httpx.Client]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model_url = stack.enter_context(serve_in_thread(make_model(backend, return_token_ids=True)))
        yield stack.enter_context(agent_client(model_url, weather_url))


# --- rollouts that succeed ---------------------------------------------------------------------------


def test_good_row_is_rewarded(agent: httpx.Client) -> None:
    row = weather_row("Paris", ["sunny", "22"], rollout_id="r-1", group_id="g-1")
    result = run(agent, row)
    RunResponse.model_validate(result)
    assert result["status"] == "ok"
    assert result["error"] is None
    assert result["reward"] == 1.0
    assert result["rollout_id"] == "r-1" and result["group_id"] == "g-1"
    assert result["city"] == "Paris" and result["expected"] == ["sunny", "22"]
    assert result["responses_create_params"] == row["responses_create_params"]
    assert result["looked_up"] == ["Paris"]

    output = result["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    call, call_output, message = output
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert call_output["call_id"] == call["call_id"]
    assert call_output["output"] == "Paris: sunny, 22 C"
    assert message_text(message) == "The weather in Paris: Paris: sunny, 22 C"

    metrics = result["metrics"]
    assert metrics["turns"] == 2
    assert metrics["tool_calls"] == 1
    assert metrics["input_tokens"] > 0 and metrics["output_tokens"] > 0
    # The final response's usage is the sum over the rollout's model calls.
    assert result["response"]["usage"]["input_tokens"] == metrics["input_tokens"]
    assert result["response"]["usage"]["output_tokens"] == metrics["output_tokens"]
    assert metrics["latency_s"] >= metrics["model_latency_s"] > 0
    # Without token ids from the model, no sequences are reported.
    assert "sequences" not in result and "prefix_ok" not in result


def test_unknown_city_is_a_real_zero(agent: httpx.Client) -> None:
    result = run(agent, weather_row("Atlantis", ["sunny"]))
    RunResponse.model_validate(result)
    assert result["status"] == "ok"
    assert result["reward"] == 0.0 and isinstance(result["reward"], float)
    assert result["error"] is None
    assert result["looked_up"] == ["Atlantis"]
    assert message_text(result["response"]["output"][-1]).startswith("The weather in Atlantis: No weather data for Atlantis.")


def test_token_sequences(token_agent: httpx.Client) -> None:
    result = run(token_agent, weather_row("Tokyo", ["cloudy", "18"]))
    RunResponse.model_validate(result)
    assert result["status"] == "ok" and result["reward"] == 1.0
    assert result["prefix_ok"] is True
    assert len(result["sequences"]) == 1
    seq = result["sequences"][0]
    ids, mask, logprobs = seq["completion_ids"], seq["completion_mask"], seq["completion_logprobs"]
    assert len(ids) == len(mask) == len(logprobs)
    assert set(mask) == {0, 1}
    for m, lp in zip(mask, logprobs):
        if m == 0:
            assert lp == 0.0
        else:
            assert lp < 0.0  # the toy backend's logprobs are strictly negative

    call, _, message = result["response"]["output"]
    # The sequence is: first prompt | first generation (mask 1) | env tokens (mask 0) | second generation (mask 1).
    assert seq["prompt_ids"] == call["prompt_token_ids"]
    gen1, gen2 = call["generation_token_ids"], message["generation_token_ids"]
    assert ids[: len(gen1)] == gen1 and mask[: len(gen1)] == [1] * len(gen1)
    assert ids[len(ids) - len(gen2):] == gen2 and mask[len(mask) - len(gen2):] == [1] * len(gen2)
    assert seq["prompt_ids"] + ids == message["prompt_token_ids"] + gen2
    assert logprobs[: len(gen1)] == call["generation_log_probs"]
    env_text = bytes(i - 3 for i, m in zip(ids, mask) if m == 0).decode()
    assert "Tokyo: cloudy, 18 C" in env_text


def test_max_steps_one(model_url: str, weather_url: str) -> None:
    with agent_client(model_url, weather_url, max_steps=1) as client:
        result = run(client, weather_row("Paris"))
    RunResponse.model_validate(result)
    assert result["status"] == "max_steps"
    assert isinstance(result["reward"], float) and result["reward"] == 0.0
    assert result["error"] is None
    assert result["metrics"]["turns"] == 1
    assert [item["type"] for item in result["response"]["output"]] == ["function_call", "function_call_output"]
    assert result["looked_up"] == ["Paris"]


def test_string_input_row(agent: httpx.Client) -> None:
    row = weather_row("Oslo", ["snowy", "-3"])
    row["responses_create_params"]["input"] = "What is the weather in Oslo?"
    result = run(agent, row)
    RunResponse.model_validate(result)
    assert result["status"] == "ok" and result["reward"] == 1.0
    assert result["looked_up"] == ["Oslo"]
    assert message_text(result["response"]["output"][-1]) == "The weather in Oslo: Oslo: snowy, -3 C"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"])
def test_forced_tool_choice_is_reset_after_the_call(agent: httpx.Client, tool_choice: Any) -> None:
    row = weather_row("Cairo", ["hot and dry", "35"])
    row["responses_create_params"]["tool_choice"] = tool_choice
    result = run(agent, row)
    RunResponse.model_validate(result)
    # Without the reset the scripted model would call the tool again on every turn until max_steps.
    assert result["status"] == "ok" and result["reward"] == 1.0
    assert result["metrics"]["turns"] == 2 and result["metrics"]["tool_calls"] == 1
    assert result["responses_create_params"]["tool_choice"] == tool_choice


def test_forced_tool_choice_without_reset_runs_to_max_steps(model_url: str, weather_url: str) -> None:
    with agent_client(model_url, weather_url, reset_tool_choice=False, max_steps=3) as client:
        row = weather_row("Cairo", ["hot and dry"])
        row["responses_create_params"]["tool_choice"] = "required"
        result = run(client, row)
    assert result["status"] == "max_steps"
    assert result["reward"] == 0.0
    assert result["metrics"]["turns"] == 3 and result["metrics"]["tool_calls"] == 3
    assert result["looked_up"] == ["Cairo"] * 3


def test_incomplete_model_response_is_truncated(agent: httpx.Client) -> None:
    row = weather_row("Paris", ["sunny"])
    # The scripted backend cuts reply text (not tool calls) to max_tokens words.
    row["responses_create_params"]["max_output_tokens"] = 2
    result = run(agent, row)
    RunResponse.model_validate(result)
    assert result["status"] == "truncated"
    assert result["reward"] == 0.0
    assert result["response"]["status"] == "incomplete"
    assert message_text(result["response"]["output"][-1]) == "The weather"


def test_a_prompt_longer_than_the_context_is_a_failure_not_a_reward(weather_url: str) -> None:
    # The backend's context holds 1500 tokens (a byte each); the model server answers `incomplete`, nothing generated.
    with scripted_backend("--max-model-len", "1500") as backend, \
            serve_in_thread(make_model(backend)) as model, agent_client(model, weather_url) as client:
        row = weather_row("Paris", ["sunny"])
        row["responses_create_params"]["input"] = "Tell me the weather in Paris. " + "Please be brief. " * 120
        result = run(client, row)
        RunResponse.model_validate(result)
        assert result["status"] == "context_overflow"
        assert result["reward"] is None and "does not fit" in result["error"]
        short = run(client, weather_row("Paris", ["sunny"]))  # the same stack, a prompt that fits
    assert short["status"] == "ok" and short["reward"] == 1.0


def test_output_token_budget_truncates_before_running_tools(model_url: str, weather_url: str) -> None:
    with agent_client(model_url, weather_url, max_total_output_tokens=1) as client:
        result = run(client, weather_row("Paris"))
    RunResponse.model_validate(result)
    assert result["status"] == "truncated"
    assert result["reward"] == 0.0
    assert [item["type"] for item in result["response"]["output"]] == ["function_call"]
    assert result["metrics"]["tool_calls"] == 0
    assert result["looked_up"] == []


def test_agent_responses_loop_without_verify(agent: httpx.Client) -> None:
    params = weather_row("Lima")["responses_create_params"]
    reply = agent.post("/v1/responses", json=params)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ModelResponse.model_validate(body)
    assert "reward" not in body
    assert [item["type"] for item in body["output"]] == ["function_call", "function_call_output", "message"]
    assert message_text(body["output"][-1]) == "The weather in Lima: Lima: foggy, 17 C"


def test_concurrent_rollouts_keep_their_sessions(agent: httpx.Client) -> None:
    known = ["Paris", "London", "Tokyo", "Cairo", "Oslo", "Lima", "Sydney", "Toronto"]
    cities = known + [f"Town{chr(ord('A') + i)}" for i in range(12)]
    rows = [weather_row(city, ["no weather data" if city.startswith("Town") else city.lower()], rollout_id=f"r{i}")
            for i, city in enumerate(cities)]
    with ThreadPoolExecutor(max_workers=len(rows)) as pool:
        results = list(pool.map(lambda row: run(agent, row), rows))
    for row, result in zip(rows, results):
        assert result["rollout_id"] == row["rollout_id"]
        assert result["status"] == "ok"
        assert result["looked_up"] == [row["city"]], result
        assert result["reward"] == 1.0, result


# --- infrastructure failures: a status, never a reward -----------------------------------------------------


def test_model_backend_failing_is_model_error(weather_url: str) -> None:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--fail-rate", "1.0"))
        model = stack.enter_context(serve_in_thread(make_model(backend, max_retries=0)))
        client = stack.enter_context(agent_client(model, weather_url, client_max_retries=0))
        result = run(client, weather_row("Paris", rollout_id="r-fail"))
        # The loop without verify reports the model failure as a 502.
        reply = client.post("/v1/responses", json=weather_row("Paris")["responses_create_params"])
        assert reply.status_code == 502, reply.text
        assert "model server answered HTTP" in reply.json()["error"]["message"]
    RunResponse.model_validate(result)
    assert result["status"] == "model_error"
    assert result["reward"] is None
    assert "HTTP" in result["error"]
    assert result["rollout_id"] == "r-fail"
    assert result["response"] is None
    assert result["metrics"]["turns"] == 0


def test_model_server_unreachable_is_model_error(weather_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with agent_client(dead, weather_url, client_max_retries=0) as client:
        result = run(client, weather_row("Paris"))
    RunResponse.model_validate(result)
    assert result["status"] == "model_error"
    assert result["reward"] is None
    assert "policy_model" in result["error"] and "connect" in result["error"]


def test_model_timeouts_are_timeout_status(weather_url: str) -> None:
    # --hang-rate 0.5 --seed 0: the backend answers its 1st request and hangs on the 2nd and 3rd, so the
    # first rollout times out on its second turn and the second rollout on its first.
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--hang-rate", "0.5", "--seed", "0"))
        model = stack.enter_context(serve_in_thread(make_model(backend, timeout_s=0.5, max_retries=0)))
        client = stack.enter_context(agent_client(model, weather_url, model_timeout_s=0.25, client_max_retries=0))
        partial = run(client, weather_row("London", ["rainy"], rollout_id="r-partial"))
        started = time.monotonic()
        first_turn = run(client, weather_row("Paris", rollout_id="r-first"))
        elapsed = time.monotonic() - started
        time.sleep(0.35)  # let the model server's own backend timeouts fire before it shuts down
    for result in (partial, first_turn):
        RunResponse.model_validate(result)
        assert result["status"] == "timeout"
        assert result["reward"] is None
        assert "timeout" in result["error"] and "policy_model" in result["error"]
    assert 0.2 <= elapsed < 2.0
    # A timeout mid-rollout keeps what was generated so far.
    assert partial["rollout_id"] == "r-partial"
    assert [item["type"] for item in partial["response"]["output"]] == ["function_call", "function_call_output"]
    assert partial["response"]["output"][1]["output"] == "London: rainy, 14 C"
    assert partial["metrics"]["turns"] == 1 and partial["metrics"]["tool_calls"] == 1
    assert first_turn["rollout_id"] == "r-first"
    assert first_turn["response"] is None
    assert first_turn["metrics"]["turns"] == 0


def test_resources_server_unreachable_is_env_error(model_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with agent_client(model_url, dead, client_max_retries=0) as client:
        result = run(client, weather_row("Paris", rollout_id="r-env"))
    RunResponse.model_validate(result)
    assert result["status"] == "env_error"
    assert result["reward"] is None
    assert "weather" in result["error"] and "/seed_session" in result["error"]
    assert result["rollout_id"] == "r-env"


# --- bad task rows ------------------------------------------------------------------------------------------


def test_row_without_city_is_422_naming_city(agent: httpx.Client) -> None:
    row = weather_row("Paris")
    del row["city"]
    reply = agent.post("/run", json=row)
    assert reply.status_code == 422, reply.text
    error = reply.json()["error"]
    assert error["field"] == "city"
    assert "seed_session" in error["message"]


def test_row_without_responses_create_params_is_422(agent: httpx.Client) -> None:
    reply = agent.post("/run", json={"city": "Paris", "expected": ["sunny"]})
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == "responses_create_params"


def test_malformed_json_row_is_400(agent: httpx.Client) -> None:
    reply = agent.post("/run", content=b"{not json", headers={"content-type": "application/json"})
    assert reply.status_code == 400
    assert reply.json()["error"]["field"] == "body"


# --- model mistakes are tool outputs, not failures ------------------------------------------------------------


class MistakeModel(ModelServer):
    """Answers the first turn with a scripted function call chosen by the user's message, then a final
    message quoting the tool output it got back."""

    CALLS = {
        "unknown-tool": ("no_such_tool", '{"city": "Paris"}'),
        "bad-json": ("get_weather", "{not json"),
        "bad-args": ("get_weather", '{"city": 5}'),
        "not-object": ("get_weather", '["Paris"]'),
        "built-in": ("verify", "{}"),
        "framework-route": ("docs", "{}"),
    }

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        items = payload["input"]
        last = items[-1]
        if last.get("type") == "function_call_output":
            output = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                       "content": [{"type": "output_text", "text": f"Tool said: {last['output']}", "annotations": []}]}]
        else:
            name, arguments = self.CALLS[last["content"]]
            output = [{"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": name,
                       "arguments": arguments, "status": "completed"}]
        return build_response(payload, output, model="mistake", usage={"input_tokens": 5, "output_tokens": 3})


@pytest.fixture(scope="module")
def mistake_agent(weather_url: str) -> Iterator[httpx.Client]:
    with serve_in_thread(MistakeModel(name="policy_model")) as model:
        with agent_client(model, weather_url) as http:
            yield http


@pytest.mark.parametrize(
    ("case", "says"),
    [
        ("unknown-tool", "Error: unknown tool 'no_such_tool'."),
        ("bad-json", "Error: the arguments of get_weather are not valid JSON"),
        ("bad-args", "Error: invalid arguments for get_weather: field 'city'"),
        ("not-object", "Error: the arguments of get_weather must be a JSON object, not list."),
        ("built-in", "Error: unknown tool 'verify'."),
        ("framework-route", "Error: unknown tool 'docs'."),
    ],
)
def test_model_mistakes_become_tool_outputs(mistake_agent: httpx.Client, case: str, says: str) -> None:
    row = weather_row("Paris", ["sunny"])
    row["responses_create_params"]["input"] = [{"role": "user", "content": case}]
    result = run(mistake_agent, row)
    RunResponse.model_validate(result)
    assert result["status"] == "ok"
    assert result["error"] is None
    assert result["reward"] == 0.0
    output = result["response"]["output"]
    assert [item["type"] for item in output] == ["function_call", "function_call_output", "message"]
    tool_output = output[1]["output"]
    assert tool_output.startswith(says), tool_output
    assert message_text(output[2]) == f"Tool said: {tool_output}"
    assert result["metrics"]["turns"] == 2 and result["metrics"]["tool_calls"] == 1
    # No mistaken call reached the weather tool.
    assert result["looked_up"] == []


def test_skip_verification_runs_the_loop_but_not_verify(token_agent: httpx.Client) -> None:
    result = run(token_agent, weather_row("Tokyo", ["cloudy", "18"], skip_verification=True))
    RunResponse.model_validate(result)
    assert result["status"] == "ok" and result["error"] is None
    assert result["reward"] is None and result["verification"] == "skipped"  # null, never a made-up 0
    assert "looked_up" not in result  # only /verify's answer carries it
    assert [item["type"] for item in result["response"]["output"]] == ["function_call", "function_call_output",
                                                                      "message"]
    assert result["prefix_ok"] is True and len(result["sequences"]) == 1
    verified = run(token_agent, weather_row("Tokyo", ["cloudy", "18"]))
    assert verified["reward"] == 1.0 and "verification" not in verified and verified["looked_up"] == ["Tokyo"]


def test_skip_verification_must_be_a_boolean(agent: httpx.Client) -> None:
    error = run(agent, weather_row("Paris", skip_verification="yes"), status_code=422)["error"]
    assert error["field"] == "skip_verification"
