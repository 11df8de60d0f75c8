"""A `rollgym train` epoch on an example agent that breaks the token prefix (agents/proxy_agent/examples):
the compacting agent (its task, a summariser's conversation, then its task again from the summary: three
segments), run unchanged as a command through `proxy_agent` in front of the scripted backend. Collection,
curation and a trainer's step in its child process: the history's line says every rollout trained all its
segments (segments_per_rollout 3, dropped_prefix_broken 0), and every model call's tokens are in the loss
of exactly one record. (The sub-agent example trains the same way; test_segment_agents.py curates both.)"""

from __future__ import annotations

from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Iterator

import orjson
import pytest
import yaml

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from agents.proxy_agent.examples.test_segment_agents import sampled_runs
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.data.jsonl import read_whole_lines
from rollgym.data.records import output_items
from rollgym.schema import RolloutLine
from rollgym.sequences import token_record
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread
from rollgym.train.loop.epochs import TrainLoop
from rollgym.train.loop.plan import load_plan

TASKS = REPO_ROOT / "resources_servers/weather/data/example.jsonl"


@pytest.fixture()
def registry_file(tmp_path: Path) -> Iterator[Path]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        registry = {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model)), "models"),
                    "weather": ServerAddress(stack.enter_context(serve_in_thread(WeatherServer(name="weather"))),
                                             "resources_servers")}
        config = ProxyAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"},
                                  timeout_s=60, agent={"kind": "command", "argv": [
                                      "python", "agents/proxy_agent/examples/compacting_agent/agent.py"]})
        agent = ProxyAgent(config, name="compacting_agent", registry=registry)
        registry["compacting_agent"] = ServerAddress(stack.enter_context(serve_in_thread(agent)), "agents")
        path = tmp_path / "stack.json"
        path.write_bytes(orjson.dumps({name: address.to_json() for name, address in registry.items()}))
        yield path


def test_an_epoch_of_the_compacting_agent_trains_every_segment(tmp_path, registry_file, importable_toys):
    plan = {"output": str(tmp_path / "run"),
            "stack": {"registry_file": str(registry_file), "agent": "compacting_agent", "concurrency": 4},
            "stages": [{"name": "sft", "epochs": 1, "collect": {"input": str(TASKS), "repeats": 2, "limit": 2},
                        "optimize": {"trainer": "tests.train.toy_trainers:CountingTrainer", "data": "sft"},
                        "apply": "none"}]}
    (tmp_path / "plan.yaml").write_text(yaml.safe_dump(plan))
    loop = TrainLoop(load_plan(tmp_path / "plan.yaml"), progress=False, log=lambda _: None)
    loop.run()
    [line] = loop.history()
    curated = line["curated"]
    assert curated["rollouts_in"] == curated["rollouts_kept"] == 4 and curated["dropped"] == {}
    assert curated["segments_per_rollout"] == 3.0 and curated["dropped_prefix_broken"] == 0
    assert line["train"]["examples"] == 12  # the trainer's child process read a record per segment
    rollouts = read_whole_lines(tmp_path / "run" / "epoch-001" / "rollouts.jsonl")
    records = read_whole_lines(tmp_path / "run" / "epoch-001" / "curated.jsonl")
    for rollout in rollouts:
        assert rollout["status"] == "ok" and rollout["reward"] == 1.0
        assert [(s["conversation"], s["segment_reason"]) for s in rollout["sequences"]] == [
            (0, None), (1, "new_conversation"), (0, "history_rewritten")]
        typed = RolloutLine.model_validate(rollout).sequences  # the schema declares the labels
        assert [(s.conversation, s.segment_reason) for s in typed] == [
            (0, None), (1, "new_conversation"), (0, "history_rewritten")]
        mine = sorted((r for r in records if r["rollout_id"] == rollout["rollout_id"]), key=lambda r: r["segment"])
        assert [r["segment"] for r in mine] == [0, 1, 2]
        trained = [run for r in mine for run in sampled_runs(r["completion_ids"], r["completion_mask"])]
        calls = [c for c in (token_record(item) for item in output_items(rollout)) if c is not None]
        assert Counter(trained) == Counter(tuple(call.generation) for call in calls)
