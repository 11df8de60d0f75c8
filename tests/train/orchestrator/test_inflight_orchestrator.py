"""In-flight weight updates through a whole stack: the orchestrator publishes step 1 while step 2's rollouts
are generating; the update aborts the generations under way (the scripted backend's `/pause?mode=abort`),
the model server continues them on the new weights, and the rollouts come back whole, rewarded as ever, with
their tokens' versions recorded; the orchestrator counts each by its oldest token.

The stack: the scripted backend (vLLM's pause routes, see rollgym.testing.scripted_vllm) behind
chat_completions with `continue_aborted`, the weather environment and the simple agent, over loopback HTTP.
The update is the loader a full-weights publish gives the orchestrator: pause with abort, the server's new
version, resume.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WEATHER, WeatherServer
from rollgym.client import ServerAddress
from rollgym.testing import scripted_backend, serve_in_thread
from rollgym.train.orchestrator.config import OrchestratorConfig
from rollgym.train.orchestrator.orchestrator import Orchestrator
from tests.conftest import simple_agent
from tests.train.orchestrator.support import weather_row, write_rows

KEPT = 3  # tokens each aborted generation keeps (the scripted backend's knob)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[dict[str, ServerAddress], ChatCompletionsModel, str]]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info", "--latency-ms", "400"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True,
                                                           continue_aborted=True), name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        weather_url = stack.enter_context(serve_in_thread(WeatherServer(name="weather")))
        agent_url = stack.enter_context(serve_in_thread(simple_agent("weather_agent", "weather", model_url,
                                                                     weather_url)))
        registry = {"policy_model": ServerAddress(model_url, "models"), "weather_agent": ServerAddress(agent_url,
                                                                                                      "agents")}
        yield registry, model, backend.removesuffix("/v1")


def test_an_update_mid_generation_is_counted_by_the_oldest_token(stack, tmp_path: Path):
    registry, model, root = stack
    aborted: list[int] = []

    async def publish(path: str, step: int) -> list[str]:
        """Step `step`'s weights: pause with abort (step 1: once a generation of step 2 is under way), the new
        version, resume."""
        async with httpx.AsyncClient(timeout=30) as http:
            deadline = time.monotonic() + (30 if step == 1 else 0)
            while not (await http.get(f"{root}/scripted/running")).json()["running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
            aborted.append((await http.get(f"{root}/scripted/running")).json()["running"])
            await http.post(f"{root}/pause", params={"mode": "abort", "scripted_keep": KEPT})
            model.config.model_version = f"policy-s{step}"
            await http.post(f"{root}/resume")
        return [f"policy-s{step}"]

    rows = [{**weather_row(entry["city"]), "expected": [entry["condition"], str(entry["temperature_c"])]}
            for entry in WEATHER.values()]  # every task solved: the reward tells a cut answer at once
    config = OrchestratorConfig.model_validate({
        "batch_size": 4, "rollouts_per_example": 2, "max_steps": 2, "max_async_level": 1, "max_off_policy_steps": 1,
        "concurrency": 4, "inflight_updates": True,
        "envs": [{"name": "weather", "input": write_rows(tmp_path / "weather.jsonl", rows), "agent": "weather_agent"}]})
    orchestrator = Orchestrator(config, registry, tmp_path / "out", log=lambda _: None, loader=publish)

    async def trainer() -> list:
        batches = []
        async for batch in orchestrator.batches():
            batches.append(batch)
            await orchestrator.finish_step(batch.step, str(tmp_path / f"weights-{batch.step}"))
        return batches

    batches = asyncio.run(asyncio.wait_for(trainer(), 120))
    assert orchestrator.version_steps == {"scripted": 0, "policy-s1": 1, "policy-s2": 2}
    mixed = [r for batch in batches for r in batch.rollouts if len(r["token_lags"]) > 1]
    assert mixed and aborted[0] >= 1  # the first update cut at least one generation short
    # A rollout whose calls ran under two versions is mixed; the call the update cut short carries the spans.
    cut = [(rollout, item) for rollout in mixed for item in rollout["response"]["output"] if "model_version_spans" in item]
    assert cut
    for rollout, last in cut:
        spans = last["model_version_spans"]
        assert [span["model_version"] for span in spans] == ["scripted", "policy-s1"] and spans[0]["tokens"] == KEPT
        assert sum(span["tokens"] for span in spans) == len(last["generation_token_ids"])
        assert last["model_version"] == "policy-s1"
        # Whole and token-exact: the answer reads as ever, the reward is the task's, the rollout one sequence.
        assert rollout["reward"] == 1.0 and rollout["prefix_ok"] is True and len(rollout["sequences"]) == 1
        assert rollout["sampled_step"] == 0 and rollout["policy_lag"] == rollout["step"] - 1
    step = {batch.step: batch.metrics for batch in batches}[mixed[0]["step"]]
    assert step["mixed_version_rollouts"] >= 1 and 0 < step["off_policy_token_share"] < 1
    assert step["policy_lag_max"] == mixed[0]["policy_lag"]
    assert sum(step["token_staleness"].values()) == sum(
        sum(r["token_lags"].values()) for batch in batches if batch.step == mixed[0]["step"] for r in batch.rollouts)


def test_an_engine_left_paused_fails_the_rollout_as_a_model_error(stack):
    """Past `resume_wait_s` the aborted generation is not continued: the rollout is a failure with its cause,
    never a reward."""
    registry, model, root = stack
    model.config.resume_wait_s = 0.5
    row = {**weather_row("Oslo"), "expected": ["snowy", "-3"]}

    async def rollout() -> dict:
        async with httpx.AsyncClient(timeout=60) as http:
            run = asyncio.create_task(http.post(f"{registry['weather_agent'].url}/run", json=row))
            while not (await http.get(f"{root}/scripted/running")).json()["running"]:
                await asyncio.sleep(0.005)
            await http.post(f"{root}/pause", params={"mode": "abort", "scripted_keep": KEPT})
            try:
                return (await run).json()
            finally:
                await http.post(f"{root}/resume")
                model.config.resume_wait_s = 300.0

    answer = asyncio.run(asyncio.wait_for(rollout(), 60))
    assert answer["status"] == "model_error" and answer["reward"] is None
    assert "still paused" in answer["error"]
