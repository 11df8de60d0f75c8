"""A `rollgym train` epoch over rollouts whose chat template strips earlier reasoning: the scripted
backend renders like Qwen3 (`--template qwen3`: an assistant's `<think>` is dropped once a later user
message follows), and an external agent run unchanged through `proxy_agent` chats over several user
turns, each with a weather tool call. Every user turn breaks the token prefix, so each rollout has one
segment per user turn; curation keeps them all (0 of the ok rollouts dropped) and every token the
model sampled is trained exactly once, with its own sampling logprob."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest
import yaml

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from agents.proxy_agent.runners import Endpoint
from agents.proxy_agent.tests.fixture_agents import WEATHER_TOOL, call_tool, openai_client, question
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.data.jsonl import read_whole_lines
from rollgym.sequences import token_record
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread
from rollgym.train.loop.curation import to_groups
from rollgym.train.loop.epochs import TrainLoop
from rollgym.train.loop.plan import load_plan
from rollgym.train.trainers.grpo_trainer import sequences_of
from rollgym.data.records import output_items

TASKS = REPO_ROOT / "resources_servers/weather/data/example.jsonl"
FOLLOW_UPS = ["And tomorrow?", "Thanks. Once more, please."]


async def chat_with_user_turns(task: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """A chat of three user turns (the task's question, then FOLLOW_UPS), each answered after a tool call;
    the assistant turns are sent back as the OpenAI SDK returns them, reasoning included."""
    client = openai_client(endpoint)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather assistant. Think first."},
                                      {"role": "user", "content": question(task)}]
    answer = ""
    for follow_up in [None, *FOLLOW_UPS]:
        if follow_up:
            messages.append({"role": "user", "content": follow_up})
        for _ in range(3):
            completion = await client.chat.completions.create(model=endpoint.model, messages=messages,
                                                              tools=[WEATHER_TOOL], max_tokens=64)
            message = completion.choices[0].message
            sent = message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
            reasoning = getattr(message, "reasoning_content", None)
            if reasoning:
                sent["reasoning_content"] = reasoning
            messages.append(sent)
            if not message.tool_calls:
                answer = message.content or ""
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": await call_tool(endpoint, call.function.name, call.function.arguments)})
    return {"answer": answer, "score": 1.0 if answer else 0.0}


def test_the_qwen3_template_keeps_reasoning_only_after_the_last_user_message() -> None:
    from rollgym.testing.scripted_vllm import render_prompt, render_segments

    turn = {"role": "assistant", "content": "sunny", "reasoning_content": "look it up"}
    within = [{"role": "user", "content": "weather?"}, turn, {"role": "tool", "content": "sunny"}]
    after = within + [{"role": "user", "content": "tomorrow?"}]
    assert "<think>look it up</think>" in "".join(t for t, _ in render_segments(within, None, template="qwen3"))
    assert "<think>" not in "".join(t for t, _ in render_segments(after, None, template="qwen3"))
    assert "<think>look it up</think>" in render_prompt(after, None)  # chatml keeps every turn's reasoning


@pytest.fixture()
def registry_file(tmp_path: Path) -> Iterator[Path]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info", "--template", "qwen3"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        model_url = stack.enter_context(serve_in_thread(model))
        registry = {"policy_model": ServerAddress(model_url, "models"),
                    "weather": ServerAddress(stack.enter_context(serve_in_thread(WeatherServer(name="weather"))),
                                             "resources_servers")}
        agent = ProxyAgent(ProxyAgentConfig(
            model_server={"name": "policy_model"}, resources_server={"name": "weather"}, reward="agent",
            agent={"kind": "callable", "target": f"{__name__}:chat_with_user_turns"}), name="chat_agent",
            registry=registry)
        registry["chat_agent"] = ServerAddress(stack.enter_context(serve_in_thread(agent)), "agents")
        path = tmp_path / "stack.json"
        path.write_bytes(orjson.dumps({name: {"url": a.url, "role": a.role} for name, a in registry.items()}))
        yield path


def test_an_epoch_trains_every_segment_of_rollouts_whose_template_strips_reasoning(
        tmp_path: Path, registry_file: Path, importable_toys: None) -> None:
    plan = {
        "output": str(tmp_path / "run"),
        "stack": {"registry_file": str(registry_file), "agent": "chat_agent", "concurrency": 2},
        "validation": {"input": str(TASKS), "repeats": 1, "limit": 1},
        "stages": [{"name": "sft", "epochs": 1, "collect": {"input": str(TASKS), "repeats": 2, "limit": 2},
                    "optimize": {"trainer": "tests.train.toy_trainers:CountingTrainer", "data": "sft"},
                    "apply": "none"}],
    }
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    loop = TrainLoop(load_plan(tmp_path / "plan.yaml"), progress=False)
    loop.run()
    curated = loop.history()[1]["curated"]
    rollouts = read_whole_lines(tmp_path / "run" / "epoch-001" / "rollouts.jsonl")
    ok = [r for r in rollouts if r.get("status") == "ok"]
    assert len(ok) == 4 and all(r["prefix_ok"] is False for r in ok)
    assert [len(r["sequences"]) for r in ok] == [3] * 4  # one segment per user turn
    assert curated["dropped"] == {} and curated["rollouts_kept"] == 4 and curated["dropped_prefix_broken"] == 0
    assert curated["segments"] == 12 and curated["segments_per_rollout"] == 3.0 and curated["records"] == 12

    records = read_whole_lines(tmp_path / "run" / "epoch-001" / "curated.jsonl")
    for row in ok:
        calls = [r for r in (token_record(item) for item in output_items(row)) if r is not None]
        assert len(calls) == 6  # a tool call and an answer per user turn
        sampled = [t for c in calls for t in c.generation]
        mine = sorted((r for r in records if r["rollout_id"] == row["rollout_id"]), key=lambda r: r["segment"])
        assert [r["segment"] for r in mine] == [0, 1, 2]
        # SFT: every model token is in the loss of exactly one record.
        trained = [t for r in mine for t, m in zip(r["completion_ids"], r["completion_mask"]) if m]
        assert trained == sampled
        # GRPO (the trainer's TrainSequences): the same tokens, each with the logprob it was sampled with.
        [sequences] = sequences_of([to_groups("g", [row])])
        assert [seq.rollout for seq in sequences] == [0, 0, 0]
        pairs = [(t, lp) for seq in sequences
                 for t, m, lp in zip(seq.completion_ids, seq.loss_mask, seq.sampling_logprobs) if m]
        assert pairs == [(t, lp) for c in calls for t, lp in zip(c.generation, c.logprobs)]
