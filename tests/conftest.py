"""Fixtures shared by the tests of services/ and the trainer integrations."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import pytest

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.reverse_text.app import ReverseTextServer
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.testing import scripted_backend, serve_in_thread


def simple_agent(name: str, env: str, model_url: str, env_url: str) -> SimpleAgent:
    return SimpleAgent(
        SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": env}), name=name,
        registry={"policy_model": ServerAddress(url=model_url, role="models"),
                  env: ServerAddress(url=env_url, role="resources_servers")},
    )


@contextmanager
def scripted_stack(*backend_flags: str, **model_options: Any) -> Iterator[dict[str, ServerAddress]]:
    """A real in-process stack: the scripted backend (with token ids; `backend_flags` add e.g.
    `--latency-ms`) behind chat_completions (`model_options`: more of its config, e.g. max_retries),
    and two agents, `reverse_text_agent` and `weather_agent`; yields its registry."""
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info", *backend_flags))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True,
                                                           **model_options), name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        reverse_url = stack.enter_context(serve_in_thread(ReverseTextServer(name="reverse_text")))
        weather_url = stack.enter_context(serve_in_thread(WeatherServer(name="weather")))
        yield {
            "policy_model": ServerAddress(model_url, "models"),
            "reverse_text_agent": ServerAddress(stack.enter_context(serve_in_thread(
                simple_agent("reverse_text_agent", "reverse_text", model_url, reverse_url))), "agents"),
            "weather_agent": ServerAddress(stack.enter_context(serve_in_thread(
                simple_agent("weather_agent", "weather", model_url, weather_url))), "agents"),
        }


@pytest.fixture(scope="module")
def scripted_agents() -> Iterator[dict[str, ServerAddress]]:
    """`scripted_stack()`, shared by a module's tests (none of which loads an adapter into it)."""
    with scripted_stack() as registry:
        yield registry
