"""`rollgym train` with `mode: async` over rollouts of several segments: the scripted backend renders like
Qwen3 (`--template qwen3`: an earlier `<think>` is dropped at each new user turn) and an agent run unchanged
through `proxy_agent` chats over three user turns, so every rollout is three segments. The orchestrator's
batches (its step folders) keep every segment; each step trains them all with the rollout's one advantage
(n_i over all of a rollout's segments), every sampled token once with its own sampling logprob; and
`curate.segments` is honoured as in epochs mode."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, Iterator

import orjson
import pytest

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from agents.proxy_agent.runners import Endpoint
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.weather.app import WeatherServer
from rollgym.client import ServerAddress
from rollgym.data.jsonl import read_whole_lines
from rollgym.data.records import output_items
from rollgym.sequences import token_record
from rollgym.testing import scripted_backend, serve_in_thread
from rollgym.train.loop.async_driver import AsyncTrainLoop
from rollgym.train.loop.plan import PlanError, load_plan
from rollgym.train.orchestrator.transports.folders import StepFolders
from rollgym.train.trainers.grpo_loss import LossConfig, sequence_scales
from rollgym.train.trainers.grpo_trainer import rollout_keys, sequences_of
from tests.train.loop.test_stripped_reasoning import TASKS, chat_with_user_turns


async def graded_chat(task: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """The three-user-turn chat, graded so that a group's rewards differ (the scripted model answers every
    rollout of a group alike): the first rollout of each group (`...-r0`) scores 1, the others 0."""
    outcome = await chat_with_user_turns(task, endpoint)
    return {**outcome, "score": 1.0 if str(task.get("rollout_id")).endswith("-r0") else 0.0}


@pytest.fixture(scope="module")
def registry_file(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with ExitStack() as stack:
        backend = stack.enter_context(scripted_backend("--token-info", "--template", "qwen3"))
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        registry = {"policy_model": ServerAddress(stack.enter_context(serve_in_thread(model)), "models"),
                    "weather": ServerAddress(stack.enter_context(serve_in_thread(WeatherServer(name="weather"))),
                                             "resources_servers")}
        agent = ProxyAgent(ProxyAgentConfig(
            model_server={"name": "policy_model"}, resources_server={"name": "weather"}, reward="agent",
            agent={"kind": "callable", "target": f"{__name__}:graded_chat"}), name="chat_agent", registry=registry)
        registry["chat_agent"] = ServerAddress(stack.enter_context(serve_in_thread(agent)), "agents")
        path = tmp_path_factory.mktemp("stack") / "stack.json"
        path.write_bytes(orjson.dumps({name: address.to_json() for name, address in registry.items()}))
        yield path


def run_async(tmp_path: Path, registry_file: Path, steps: int, **changes: Any) -> Path:
    plan = {"output": str(tmp_path / "run"), "mode": "async",
            "stack": {"registry_file": str(registry_file), "agent": "chat_agent"},
            "orchestrator": {"batch_size": 4, "rollouts_per_example": 2, "max_steps": steps, "max_async_level": 1,
                             "max_off_policy_steps": 2, "concurrency": 4,
                             "envs": [{"name": "weather", "input": str(TASKS), "agent": "chat_agent"}]},
            "optimize": {"trainer": "tests.train.toy_trainers:CountingTrainer", "data": "groups"}, **changes}
    (tmp_path / "plan.json").write_bytes(orjson.dumps(plan))
    AsyncTrainLoop(load_plan(tmp_path / "plan.json"), progress=False, log=lambda _: None).run()
    return tmp_path / "run"


def trained(run: Path, step: int) -> tuple[list[dict[str, Any]], dict[str, list[Any]], list[Any]]:
    """Step `step`'s batch as the orchestrator published it, and what the GRPO trainer's loss sees of its
    curated.jsonl: per rollout id its TrainSequences (one per segment trained), and all of them in order."""
    batch = StepFolders(run / "orchestrator" / "steps").read(step).rollouts
    groups = read_whole_lines(run / f"step-{step:03d}" / "curated.jsonl")
    ids = [member["rollout_id"] for group in groups for member in group["rollouts"]]
    sequences = [seq for group in sequences_of(groups) for seq in group]
    return batch, {rid: [s for s in sequences if s.rollout == n] for n, rid in enumerate(ids)}, sequences


def test_async_steps_train_every_segment_with_its_rollouts_advantage(tmp_path, registry_file, importable_toys):
    run = run_async(tmp_path, registry_file, steps=2)
    history = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines()]
    assert [line["step"] for line in history] == [1, 2]
    for line in history:
        curated = line["curated"]
        assert curated["dropped"] == {} and curated["dropped_prefix_broken"] == 0 and curated["rollouts_kept"] == 4
        assert curated["segments"] == 12 and curated["segments_per_rollout"] == 3.0
        assert line["train"]["examples"] == 2.0  # the CountingTrainer read the step's two groups
    for step in (1, 2):
        batch, by_rollout, sequences = trained(run, step)
        assert len(batch) == 4 and sorted(by_rollout) == sorted(r["rollout_id"] for r in batch)
        for rollout in batch:
            assert rollout["status"] == "ok" and len(rollout["sequences"]) == 3  # the step folder kept them all
            # Rewards 1 and 0 in every group: normalised advantages +1 and -1 (up to the std's epsilon).
            assert rollout["advantage"] == pytest.approx(1.0 if rollout["reward"] else -1.0, rel=1e-4)
            mine = by_rollout[rollout["rollout_id"]]
            assert len(mine) == 3 and {seq.advantage for seq in mine} == {rollout["advantage"]}
            calls = [c for c in (token_record(item) for item in output_items(rollout)) if c is not None]
            assert len(calls) == 6  # a tool call and an answer per user turn
            # Every token the model sampled is in the loss exactly once, in order, with its sampling logprob.
            pairs = [(t, lp) for seq in mine for t, m, lp in zip(seq.completion_ids, seq.loss_mask,
                                                                seq.sampling_logprobs) if m]
            assert pairs == [(t, lp) for c in calls for t, lp in zip(c.generation, c.logprobs)]
        # sequence_mean: n_i counts all of a rollout's segments, so each rollout weighs 1/N of the loss.
        scales = sequence_scales([s.loss_tokens for s in sequences], LossConfig(aggregation="sequence_mean"),
                                 rollout_keys(sequences))
        weights: dict[Any, float] = {}
        for seq, scale in zip(sequences, scales):
            weights[seq.rollout] = weights.get(seq.rollout, 0.0) + scale * seq.loss_tokens
        assert sorted(weights) == [0, 1, 2, 3] and all(w == pytest.approx(0.25) for w in weights.values())


def test_async_curate_segments_last_trains_only_the_last_segment(tmp_path, registry_file, importable_toys):
    run = run_async(tmp_path, registry_file, steps=1, curate={"segments": "last"})
    [line] = [orjson.loads(line) for line in (run / "history.jsonl").read_bytes().splitlines()]
    curated = line["curated"]
    assert curated["segments"] == 4 and curated["segments_per_rollout"] == 1.0
    assert curated["segments_left_out"] == 8 and curated["dropped"] == {}
    batch, by_rollout, _ = trained(run, 1)
    for rollout in batch:
        [last] = by_rollout[rollout["rollout_id"]]
        assert last.completion_ids == rollout["sequences"][-1]["completion_ids"]
        assert last.advantage == rollout["advantage"]


def test_async_plan_takes_curate_segments_only(tmp_path, registry_file):
    base = {"output": str(tmp_path / "run"), "stack": {"registry_file": str(registry_file), "agent": "chat_agent"}}
    async_plan = {**base, "mode": "async", "optimize": {"trainer": "grpo"},
                  "orchestrator": {"batch_size": 4, "rollouts_per_example": 2,
                                   "envs": [{"name": "weather", "input": str(TASKS)}]}}
    (tmp_path / "plan.json").write_bytes(orjson.dumps({**async_plan, "curate": {"segments": "drop"}}))
    assert load_plan(tmp_path / "plan.json").curate.segments == "drop"
    (tmp_path / "plan.json").write_bytes(orjson.dumps({**async_plan, "curate": {"min_reward": 1.0}}))
    with pytest.raises(PlanError, match="curate.min_reward"):
        load_plan(tmp_path / "plan.json")
    stage = {"name": "s", "collect": {"input": str(TASKS)}, "optimize": {"trainer": "grpo"}}
    (tmp_path / "plan.json").write_bytes(orjson.dumps({**base, "stages": [stage], "curate": {"segments": "last"}}))
    with pytest.raises(PlanError, match=r"stages\[i\].curate"):
        load_plan(tmp_path / "plan.json")
