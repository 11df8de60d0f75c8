"""A temperature schedule in async mode (`envs[].params.temperature: {type: linear | cosine, ...}` over
`max_steps`), end to end: the scripted backend (vLLM's stand-in) behind chat_completions, reverse_text and a
simple agent over loopback HTTP. Each step's model requests carry that step's temperature, and every generated
item of the step's batch records it (`sampling.temperature`), which is what the RL trainer reads."""

from __future__ import annotations

import asyncio
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.reverse_text.app import ReverseTextServer
from rollgym.client import ServerAddress
from rollgym.data.sampling import TemperatureSchedule
from rollgym.sequences import token_record
from rollgym.testing import scripted_backend, serve_in_thread
from rollgym.train.orchestrator.config import OrchestratorConfig
from rollgym.train.orchestrator.orchestrator import Orchestrator
from tests.conftest import simple_agent
from tests.train.orchestrator.support import medium_rows, write_rows


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, dict[str, ServerAddress]]]:
    """(the scripted backend's URL, the registry of a model server and a reverse_text agent in front of it)."""
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        env_url = stack.enter_context(serve_in_thread(ReverseTextServer(name="reverse_text")))
        agent_url = stack.enter_context(serve_in_thread(simple_agent("agent", "reverse_text", model_url, env_url)))
        yield backend, {"policy_model": ServerAddress(model_url, "models"), "agent": ServerAddress(agent_url, "agents")}


def backend_temperatures(backend: str) -> list[float]:
    """The temperature of every chat request the backend answered, oldest first."""
    logged = httpx.get(f"{backend.removesuffix('/v1')}/scripted/requests", timeout=10).json()["requests"]
    return [entry["body"]["temperature"] for entry in logged if entry["path"].endswith("/chat/completions")]


@pytest.mark.parametrize("kind, expected", [("linear", [1.0, 0.75, 0.5]), ("cosine", [1.2, 1.0, 0.6, 0.4])])
def test_each_step_samples_at_its_scheduled_temperature(stack, tmp_path: Path, kind: str,
                                                         expected: list[float]) -> None:
    backend, registry = stack
    start, end, steps = expected[0], expected[-1], len(expected)
    schedule = {"type": kind, "start_temperature": start, "end_temperature": end}
    config = OrchestratorConfig.model_validate({
        "batch_size": 4, "rollouts_per_example": 2, "max_steps": steps, "concurrency": 4, "model_servers": [],
        "max_async_level": 0,  # a step's groups are sent once the step before is finished: requests in step order
        "envs": [{"name": "reverse", "input": write_rows(tmp_path / "tasks.jsonl", medium_rows(12)),
                  "params": {"temperature": schedule, "max_output_tokens": 16}}]})
    assert [TemperatureSchedule.model_validate(schedule).at(step, steps - 1)
            for step in range(steps)] == expected
    httpx.post(f"{backend.removesuffix('/v1')}/scripted/clear", timeout=10).raise_for_status()
    orchestrator = Orchestrator(config, registry, tmp_path / "out", log=lambda _: None)

    async def train() -> list[Any]:
        batches = []
        async for batch in orchestrator.batches():
            batches.append(batch)
            await orchestrator.finish_step(batch.step, None)
        return batches

    batches = asyncio.run(train())
    assert [batch.step for batch in batches] == list(range(1, steps + 1))
    for batch, temperature in zip(batches, expected):
        assert len(batch.rollouts) == 4
        for rollout in batch.rollouts:
            assert rollout["generated_for_step"] == batch.step
            assert rollout["responses_create_params"]["temperature"] == temperature
            generated = [item for item in rollout["response"]["output"] if token_record(item) is not None]
            assert generated and all(item["sampling"]["temperature"] == temperature for item in generated)
    # What the backend was asked, in order: step 1's four model calls, then step 2's, and so on.
    assert backend_temperatures(backend) == [t for t in expected for _ in range(4)]
