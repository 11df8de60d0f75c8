"""What the orchestrator's tests share: task rows with known rewards under the scripted policy, and a stack."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator

import orjson

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.reverse_text.app import ReverseTextServer
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.testing import scripted_backend, serve_in_thread

SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."


def reverse_row(word: str, graded_against: str | None = None) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": f"Reverse this text: {word}"}],
                                        "max_output_tokens": 16},
            "text": graded_against or word}


def weather_row(city: str) -> dict[str, Any]:
    tool = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [tool]}, "city": city, "expected": ["sunny", "22"]}


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return str(path)


def medium_rows(count: int, prefix: str = "m") -> list[dict[str, Any]]:
    """Tasks the scripted policy half-solves (reward 2/3): the difficulty filter keeps them."""
    return [reverse_row(f"{prefix}{i:03d}ab", f"{prefix}{i:03d}xy") for i in range(count)]


def simple_agent(name: str, env: str, model_url: str, env_url: str) -> SimpleAgent:
    return SimpleAgent(
        SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": env}), name=name,
        registry={"policy_model": ServerAddress(url=model_url, role="models"),
                  env: ServerAddress(url=env_url, role="resources_servers")},
    )


@contextmanager
def scripted_stack(*backend_flags: str, model_retries: int = 3) -> Iterator[dict[str, ServerAddress]]:
    """The scripted backend (with `backend_flags`) behind one model server, and two agents; yields the registry."""
    with ExitStack() as exits:
        backend = exits.enter_context(scripted_backend("--token-info", *backend_flags))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True,
                                                           max_retries=model_retries),
                                     name="policy_model")
        model_url = exits.enter_context(serve_in_thread(model))
        reverse_url = exits.enter_context(serve_in_thread(ReverseTextServer(name="reverse_text")))
        weather_url = exits.enter_context(serve_in_thread(WeatherServer(name="weather")))
        yield {
            "policy_model": ServerAddress(model_url, "models"),
            "reverse_text_agent": ServerAddress(exits.enter_context(serve_in_thread(
                simple_agent("reverse_text_agent", "reverse_text", model_url, reverse_url))), "agents"),
            "weather_agent": ServerAddress(exits.enter_context(serve_in_thread(
                simple_agent("weather_agent", "weather", model_url, weather_url))), "agents"),
        }
