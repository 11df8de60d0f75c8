"""The streaming orchestrator against a real stack: the scripted backend (a stand-in for vLLM) behind the
chat_completions model server, reverse_text and weather environments, simple agents, all over loopback HTTP.

The scripted policy is deterministic, so a task's reward is set by its row: reverse_text grades the answer
(the prompt's text reversed) against the row's `text`, so `text` equal to the prompt's gives 1.0 ("easy"),
a disjoint one 0.0 ("hard") and a partly overlapping one 2/3 (kept).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import orjson
import pytest

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.client import ServerAddress
from rollgym.testing import scripted_backend, serve_in_thread
from rollgym.data.records import model_versions
from rollgym.train.orchestrator.orchestrator import Orchestrator, OrchestratorError
from rollgym.train.orchestrator.config import OrchestratorConfig
from rollgym.train.orchestrator.transports.folders import Batch
from tests.train.orchestrator.support import medium_rows, reverse_row, scripted_stack, weather_row, write_rows



@pytest.fixture(scope="module")
def stack() -> Iterator[dict[str, ServerAddress]]:
    """The scripted backend answering after 5 ms, and two agents on one model server."""
    with scripted_stack("--latency-ms", "5") as registry:
        yield registry


def config(tmp_path: Path, rows: list[dict[str, Any]] | None = None, **overrides: Any) -> OrchestratorConfig:
    envs = overrides.pop("envs", None) or [
        {"name": "reverse", "input": write_rows(tmp_path / "reverse.jsonl", rows or medium_rows(40)),
         "agent": "reverse_text_agent"}]
    base = {"batch_size": 8, "rollouts_per_example": 2, "max_steps": 3, "concurrency": 8, "model_servers": [],
            "envs": envs}
    return OrchestratorConfig.model_validate({**base, **overrides})


async def train(orchestrator: Orchestrator, delay_s: float = 0.0,
                seen: list[tuple[int, int]] | None = None) -> list[Batch]:
    """An in-test trainer: takes each batch, 'trains' for `delay_s`, finishes the step (no new weights)."""
    batches = []
    async for batch in orchestrator.batches():
        if seen is not None:
            seen.append((batch.step, orchestrator.version))
        batches.append(batch)
        await asyncio.sleep(delay_s)
        await orchestrator.finish_step(batch.step, None)
    return batches


def history(tmp_path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (tmp_path / "out" / "history.jsonl").read_bytes().splitlines()]


def test_batches_are_full_whole_groups_with_advantages(stack, tmp_path):
    orchestrator = Orchestrator(config(tmp_path), stack, tmp_path / "out", log=lambda _: None)
    batches = asyncio.run(train(orchestrator))
    assert [b.step for b in batches] == [1, 2, 3]
    ids = [r["rollout_id"] for b in batches for r in b.rollouts]
    assert len(ids) == len(set(ids)) == 24
    for batch in batches:
        groups = batch.groups()
        assert len(batch.rollouts) == 8 and [len(g) for g in groups] == [2, 2, 2, 2]
        for rollout in batch.rollouts:
            assert rollout["reward"] == pytest.approx(2 / 3)
            assert rollout["advantage"] == pytest.approx(0.0)  # equal rewards: no advantage
            assert rollout["step"] == batch.step and rollout["env"] == "reverse"
            assert 0 <= rollout["policy_lag"] <= 8  # max_off_policy_steps (a kept group may spill over)
    lines = history(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    for key in ("rollouts_per_s", "reward_mean", "reward_std", "dropped", "staleness", "trainer_wait_s",
                "inference_wait_s", "slots_busy"):
        assert key in lines[0]
    assert lines[0]["reward_mean"] == pytest.approx(2 / 3) and lines[0]["rollouts"] == 8


def test_difficulty_filter_refills_the_batch(stack, tmp_path):
    rows = []
    for i in range(30):  # per ten tasks: four easy (1.0), three hard (0.0), three kept (2/3)
        kind = i % 10
        word = f"w{i:03d}ab"
        rows.append(reverse_row(word, word if kind < 4 else ("zzzzzz" if kind < 7 else f"w{i:03d}xy")))
    cfg = config(tmp_path, rows, difficulty={"enabled": True}, oversampling_factor=2.0)
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    batches = asyncio.run(train(orchestrator))
    for batch in batches:
        assert len(batch.rollouts) == 8
        assert all(r["reward"] == pytest.approx(2 / 3) for r in batch.rollouts)
    lines = history(tmp_path)
    assert sum(line["dropped"]["easy"] for line in lines) > 0
    assert sum(line["dropped"]["hard"] for line in lines) > 0
    assert all(line["dropped"]["failed"] == 0 for line in lines)


def test_a_filter_that_drops_everything_stops_with_a_reason(stack, tmp_path):
    rows = [reverse_row(f"e{i:03d}") for i in range(10)]  # all solved: all easy
    cfg = config(tmp_path, rows, difficulty={"enabled": True}, max_drops_per_step=6)
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    with pytest.raises(OrchestratorError, match=r"'reverse': all 10 tasks are in the difficulty pools \(easy 10, "
                                                r"hard 0\)"):
        asyncio.run(train(orchestrator))


def test_too_many_drops_publish_a_smaller_batch_and_pooled_tasks_are_not_resent(stack, tmp_path):
    """Ten easy tasks and two that teach: step 1 drops its limit of easy groups and is published with what
    it has instead of ending the run; the easy tasks go to the pool and, with easy_fraction 0, are never
    sent again, so the later steps fill from the two that teach."""
    rows = [reverse_row(f"e{i:03d}ab") for i in range(10)]
    rows += [reverse_row(f"m{i:03d}ab", f"m{i:03d}xy") for i in range(2)]  # 2/3: kept
    cfg = config(tmp_path, rows, difficulty={"enabled": True}, max_drops_per_step=6, shuffle=False)
    logged: list[str] = []
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=logged.append)
    batches = asyncio.run(train(orchestrator))
    lines = history(tmp_path)
    assert [line["step"] for line in lines] == [1, 2, 3]
    # The task that teaches is dispatched only after six easy groups came back (five in flight at most).
    assert lines[0]["groups_short"] == 3 and len(batches[0].rollouts) == 2
    assert any("a batch of" in line for line in logged)
    assert [line["groups_short"] for line in lines[1:]] == [0, 0]
    assert all(r["reward"] == pytest.approx(2 / 3) for batch in batches for r in batch.rollouts)
    # Pooled once judged: a second pass resends at most those still in flight when it began, a third none.
    assert sum(line["dropped"]["easy"] for line in lines) <= 15 and lines[2]["dropped"]["easy"] == 0
    assert orchestrator.sources["reverse"].pools["easy"] == set(range(10))


def test_failed_groups_still_stop_a_step_with_their_cause(tmp_path):
    with scripted_stack("--fail-rate", "1.0") as failing:
        cfg = config(tmp_path, max_drops_per_step=2, max_attempts=1)
        orchestrator = Orchestrator(cfg, failing, tmp_path / "out", log=lambda _: None)
        with pytest.raises(OrchestratorError, match=r"step 1: 2 groups failed .*/out/failures\.jsonl"):
            asyncio.run(train(orchestrator))
    failures = [orjson.loads(line) for line in (tmp_path / "out" / "failures.jsonl").read_bytes().splitlines()]
    assert failures and all("scripted failure" in str(failure) for failure in failures)


def test_env_ratios_are_exact_per_step(stack, tmp_path):
    envs = [
        {"name": "reverse", "input": write_rows(tmp_path / "r.jsonl", medium_rows(30)),
         "agent": "reverse_text_agent", "ratio": 3},
        {"name": "weather", "input": write_rows(tmp_path / "w.jsonl", [weather_row(c) for c in
                                                                       ("Paris", "London", "Tokyo", "Lima")]),
         "agent": "weather_agent", "ratio": 1},
    ]
    cfg = config(tmp_path, envs=envs, batch_size=8, rollouts_per_example=2, max_steps=4, oversampling_factor=1.5)
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    batches = asyncio.run(train(orchestrator))
    for batch in batches:
        envs_in = [group[0]["env"] for group in batch.groups()]
        assert envs_in.count("reverse") == 3 and envs_in.count("weather") == 1
    assert [line["envs"] for line in history(tmp_path)] == [{"reverse": 3, "weather": 1}] * 4


def test_duplicate_tasks_are_skipped(stack, tmp_path):
    rows = medium_rows(4) * 3  # each task three times
    cfg = config(tmp_path, rows, batch_size=8, rollouts_per_example=2, max_steps=1)
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    assert orchestrator.duplicates == {"reverse": 8}
    batch = asyncio.run(train(orchestrator))[0]
    texts = [group[0]["text"] for group in batch.groups()]
    assert sorted(texts) == sorted(row["text"] for row in medium_rows(4))  # four distinct tasks, each once


@pytest.mark.parametrize("async_level", [0, 1, 2])
def test_staleness_bounds_with_a_slow_trainer(stack, tmp_path, async_level):
    cfg = config(tmp_path, max_steps=5, max_async_level=async_level, max_off_policy_steps=async_level,
                 oversampling_factor=1.5)
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    seen: list[tuple[int, int]] = []
    batches = asyncio.run(train(orchestrator, delay_s=0.25, seen=seen))
    # The trainer never gets a batch more than async_level steps ahead of its version.
    assert all(step - 1 - version <= async_level for step, version in seen)
    # No group was dispatched for a step beyond the bound.
    assert all(tag - 1 - version <= async_level for tag, version in orchestrator.dispatch_log)
    lags = [r["policy_lag"] for b in batches for r in b.rollouts]
    assert max(lags) <= async_level and min(lags) >= 0
    lines = history(tmp_path)
    assert sum(line["inference_wait_s"] for line in lines[1:]) > 0.1  # inference waited for the trainer
    if async_level == 0:
        assert all(lag == 0 for lag in lags)  # synchronous: every rollout on-policy
        assert sum(line["dropped"]["stale"] for line in lines) > 0  # oversampled groups came too late


def test_a_fast_trainer_waits_for_batches(stack, tmp_path):
    cfg = config(tmp_path, max_steps=4, max_async_level=1, max_off_policy_steps=1)
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    batches = asyncio.run(train(orchestrator, delay_s=0.0))
    lags = [r["policy_lag"] for b in batches for r in b.rollouts]
    assert max(lags) <= 1
    lines = history(tmp_path)
    assert all(line["trainer_wait_s"] > 0 for line in lines)
    assert sum(line["inference_wait_s"] for line in lines) < sum(line["trainer_wait_s"] for line in lines)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="multiple of rollouts_per_example"):
        config(tmp_path, batch_size=7, rollouts_per_example=2)
    with pytest.raises(ValueError, match="max_off_policy_steps"):
        config(tmp_path, max_async_level=2, max_off_policy_steps=1)
    with pytest.raises(ValueError, match="agent 'nobody' is not in the stack"):
        Orchestrator(config(tmp_path, envs=[{"name": "r", "input": write_rows(tmp_path / "r.jsonl", medium_rows(2)),
                                             "agent": "nobody"}]), {}, tmp_path / "out")
    with pytest.raises(ValueError, match="does not exist"):
        Orchestrator(config(tmp_path, envs=[{"name": "r", "input": str(tmp_path / "missing.jsonl")}]), {},
                     tmp_path / "out")


def test_failures_are_retried_reported_and_never_in_a_batch(tmp_path):
    with scripted_stack("--fail-rate", "0.75", "--seed", "3", model_retries=0) as registry:
        cfg = config(tmp_path, max_attempts=2, max_steps=2)
        orchestrator = Orchestrator(cfg, registry, tmp_path / "out", log=lambda _: None)
        batches = asyncio.run(train(orchestrator))
    for batch in batches:
        assert len(batch.rollouts) == 8 and all(r["status"] == "ok" for r in batch.rollouts)
        assert all(len(group) == 2 for group in batch.groups())
    lines = history(tmp_path)
    assert all(set(line["failures"]) <= {"model_error", "agent_error", "timeout"} for line in lines)
    failures = [orjson.loads(line) for line in (tmp_path / "out" / "failures.jsonl").read_bytes().splitlines()]
    assert failures and all(f["error"] and f["env"] == "reverse" for f in failures)
    final = [f for f in failures if f["final"]]
    used = {r["rollout_id"] for b in batches for r in b.rollouts}
    assert not used & {f["rollout_id"] for f in final}  # a failed slot never reaches a batch
    # Every group with a final failure was dropped as 'failed' and replaced (in the step it came back in,
    # or after the last step when it was still in flight then).
    assert sum(line["dropped"]["failed"] for line in lines) <= len({f["group_id"] for f in final})
    assert sum(line["failures"].get(status, 0) for line in lines for status in line["failures"]) <= len(final)


def test_hot_loaded_versions_bound_what_each_step_is_sampled_from(stack, tmp_path):
    """The trainer publishes an adapter per step; the scripted backend answers '[policy] ...' once one
    is loaded and every item says which adapter (policy@DIGEST) sampled it: the bounds hold on those versions."""
    cfg = config(tmp_path, max_steps=5, max_async_level=1, max_off_policy_steps=1, oversampling_factor=1.5,
                 model_servers=None)
    orchestrator = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)

    async def trainer() -> list[Batch]:
        batches = []
        async for batch in orchestrator.batches():
            batches.append(batch)
            await asyncio.sleep(0.2)
            adapter = tmp_path / "adapters" / f"step_{batch.step}"
            adapter.mkdir(parents=True)
            await orchestrator.finish_step(batch.step, adapter)
        return batches

    batches = asyncio.run(trainer())
    assert orchestrator.version_steps["scripted"] == 0 and len(orchestrator.version_steps) == 6
    sampled = []
    for batch in batches:
        for rollout in batch.rollouts:
            versions = model_versions(rollout, served_model=False)
            assert versions and rollout["sampled_step"] == min(orchestrator.version_steps[v] for v in versions)
            answer = rollout["response"]["output"][-1]["content"][0]["text"]
            assert answer.startswith("[policy] ") == (rollout["sampled_step"] >= 1)
            # Generation for step g started only once the adapter of step g - 1 - max_async_level was loaded.
            assert rollout["sampled_step"] >= rollout["generated_for_step"] - 2
            assert 0 <= rollout["policy_lag"] <= 1
            sampled.append(rollout["sampled_step"])
    assert max(sampled) >= 3  # the policy moved on while the run went on


def test_steps_that_train_nothing_keep_the_served_weights_current_also_after_a_resume(stack, tmp_path):
    """A step with no new weights (no group with a reward spread) leaves the base served: that is the next
    step's policy too, so what it samples is on-policy. Before, the base stayed version 0 and every group
    of step 3 came out 2 steps stale and was dropped, again and again, for ever; a resumed run too."""
    cfg = config(tmp_path, max_steps=4, max_async_level=1, max_off_policy_steps=1, model_servers=None)

    async def trainer(orchestrator: Orchestrator, stop_after: int | None = None) -> list[Batch]:
        batches = []
        async with contextlib.aclosing(orchestrator.batches(persist=True)) as stream:
            async for batch in stream:
                batches.append(batch)
                await orchestrator.finish_step(batch.step, None)
                if batch.step == stop_after:
                    break
        return batches

    first = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    before = asyncio.run(asyncio.wait_for(trainer(first, stop_after=3), 60))
    assert [b.step for b in before] == [1, 2, 3] and first.version_steps == {"scripted": 3}
    resumed = Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)
    after = asyncio.run(asyncio.wait_for(trainer(resumed), 60))
    assert [b.step for b in after] == [4] and resumed.version_steps == {"scripted": 4}
    assert all(0 <= r["policy_lag"] <= 1 for batch in before + after for r in batch.rollouts)
    assert sum(line["dropped"]["stale"] for line in history(tmp_path)) == 0


def test_steps_finish_in_order_and_only_once_handed_out(stack, tmp_path):
    orchestrator = Orchestrator(config(tmp_path, max_steps=2), stack, tmp_path / "out", log=lambda _: None)

    async def trainer() -> None:
        async for batch in orchestrator.batches():
            if batch.step == 1:
                with pytest.raises(ValueError, match="step 2 cannot finish before step 1"):
                    await orchestrator.finish_step(2, None)
            await orchestrator.finish_step(batch.step, None)
            await orchestrator.finish_step(batch.step, None)  # again: a no-op

    asyncio.run(trainer())
    assert orchestrator.version == 2
    fresh = Orchestrator(config(tmp_path, max_steps=2), stack, tmp_path / "fresh", log=lambda _: None)
    with pytest.raises(ValueError, match="step 1 has not been handed to the trainer yet"):
        asyncio.run(fresh.finish_step(1, None))


def test_adapters_go_only_to_the_model_server_the_agents_sample_from(stack, tmp_path):
    """A judge model server in the same stack keeps its weights: with no `model_servers` configured, the
    orchestrator asks the agents (GET /health) which model server they sample from and loads there only."""
    with scripted_backend("--token-info") as backend:
        judge = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="judge"), name="judge_model")
        with serve_in_thread(judge) as judge_url:
            registry = {**stack, "judge_model": ServerAddress(judge_url, "models")}
            orchestrator = Orchestrator(config(tmp_path, max_steps=2, model_servers=None), registry,
                                        tmp_path / "out", log=lambda _: None)

            async def trainer() -> None:
                async for batch in orchestrator.batches():
                    adapter = tmp_path / "adapters" / f"step_{batch.step}"
                    adapter.mkdir(parents=True)
                    await orchestrator.finish_step(batch.step, adapter)

            asyncio.run(trainer())
            judge_models = [card["id"] for card in httpx.get(f"{judge_url}/v1/models").json()["data"]]
    assert orchestrator.model_servers == ["policy_model"]
    assert judge_models == ["judge"]
    policy_models = [card["id"] for card in httpx.get(f"{stack['policy_model'].url}/v1/models").json()["data"]]
    assert "policy" in policy_models


@pytest.mark.parametrize("enforce", [True, False])
def test_rollout_filters_flag_and_enforce_and_the_step_metrics_count_them(stack, tmp_path, enforce):
    """Surogate's filters[] in mode: async, from their one home (rollgym.data.rollout_filters): every sampled token
    above probability 1e-9 flags each rollout; enforced, the trainer's curation leaves it out (its group's
    advantages counted it), counted only, it trains."""
    from rollgym.train.loop.curation import CurateConfig, curate

    flags_all = {"type": "repetition", "window": 1, "prob_threshold": 1e-9, "enforce": enforce}
    flags_none = {"type": "gibberish", "vocab_size": 2, "token_id_threshold": 10**9, "enforce": True}
    cfg = config(tmp_path, max_steps=1, filters=[flags_all, flags_none])
    batches = asyncio.run(train(Orchestrator(cfg, stack, tmp_path / "out", log=lambda _: None)))
    rollouts = batches[0].rollouts
    assert all(r["flagged"] == ["repetition"] for r in rollouts)
    assert all(r.get("filtered") == ("repetition" if enforce else None) for r in rollouts)
    line = history(tmp_path)[0]
    assert line["flagged"] == {"repetition": 8} and line["filtered_rollouts"] == (8 if enforce else 0)
    curated = curate(rollouts, "groups", CurateConfig(keep_flat_groups=True), group_size=2, keep_advantages=True)
    assert curated.flagged == {"repetition": 8}
    assert curated.dropped.get("repetition", 0) == (8 if enforce else 0)
    assert sum(len(record["rollouts"]) for record in curated.records) == (0 if enforce else 8)
