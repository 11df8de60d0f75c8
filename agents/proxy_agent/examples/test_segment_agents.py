"""The context-compacting and the sub-agent examples, unchanged (as commands), through the proxy in front
of the scripted backend (vLLM's stand-in: its toy tokenizer makes every token readable): each rollout
comes back as several segments, labelled by conversation and by why each began, and curation with
`curate.segments: all` trains every one of them, every sampled token in exactly one sample."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from agents.proxy_agent.app import ProxyAgent, ProxyAgentConfig
from agents.proxy_agent.tests.test_app import decode, registry  # noqa: F401 - the scripted stack's fixture
from rollgym.client import ServerAddress
from rollgym.sequences import token_record
from rollgym.testing import serve_in_thread
from rollgym.train.loop.curation import CurateConfig, curate, to_groups
from rollgym.train.trainers.grpo_trainer import sequences_of
from rollgym.view.app import ViewServer
from rollgym.view.runs import Catalog

CITIES = {"Paris": ["sunny", "22"], "London": ["rainy", "14"]}


def collect(registry: dict[str, ServerAddress], example: str) -> list[dict[str, Any]]:
    """Two rollouts (one GRPO group) of each city, run in parallel through the proxy's /run."""
    config = ProxyAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "weather"},
                              timeout_s=60, agent={"kind": "command",
                                                   "argv": ["python", f"agents/proxy_agent/examples/{example}/agent.py"]})
    rows = [{"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}]},
             "city": city, "expected": expected, "rollout_id": f"{city}-{n}", "group_id": city}
            for city, expected in CITIES.items() for n in range(2)]
    with serve_in_thread(ProxyAgent(config, name="proxy_agent", registry=registry)) as url, \
            httpx.Client(timeout=120) as http:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(len(rows)) as pool:
            replies = list(pool.map(lambda row: http.post(f"{url}/run", json=row), rows))
    assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
    return [reply.json() for reply in replies]


def calls_of(rollout: dict[str, Any]) -> list[Any]:
    return [r for r in (token_record(item) for item in rollout["response"]["output"]) if r is not None]


def sampled_runs(ids: list[int], mask: list[int]) -> list[tuple[int, ...]]:
    """The runs of model-sampled tokens (mask 1): one per model call."""
    runs, current = [], []
    for token, m in zip(ids, mask):
        if m:
            current.append(token)
        elif current:
            runs.append(tuple(current))
            current = []
    return runs + ([tuple(current)] if current else [])


def viewed_starts(rollouts: list[dict[str, Any]], folder: Path) -> list[list[tuple[Any, ...]]]:
    """What `rollgym view` says where each segment of each rollout begins: (conversation, reason, and
    whether the tokens' own reading is there), through the viewer's HTTP API over the rollouts file."""
    path = folder / "rollouts.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rollouts))
    with serve_in_thread(ViewServer(Catalog([path]))) as url, httpx.Client(base_url=url, timeout=30) as http:
        views = [http.get(f"/api/runs/r0/rollouts/{line}").json()["tokens"] for line in range(len(rollouts))]
    return [[(s["start"]["conversation"], s["start"]["reason"], "tokens" in s["start"]) for s in v["sequences"]]
            for v in views]


def check_every_segment_trains(rollouts: list[dict[str, Any]], segments: int) -> None:
    """SFT: one record per segment, each model call's tokens in the loss of exactly one; GRPO (what the
    trainer's loss sees): every segment a sequence of its rollout, each token with its sampling logprob."""
    sft = curate(rollouts, "sft", CurateConfig(segments="all"))
    assert sft.rollouts_kept == len(rollouts) and not sft.dropped
    assert sft.summary()["segments_per_rollout"] == segments and sft.summary()["dropped_prefix_broken"] == 0
    for rollout in rollouts:
        mine = sorted((r for r in sft.records if r["rollout_id"] == rollout["rollout_id"]), key=lambda r: r["segment"])
        assert [r["segment"] for r in mine] == list(range(segments))
        trained = [run for r in mine for run in sampled_runs(r["completion_ids"], r["completion_mask"])]
        assert Counter(trained) == Counter(tuple(call.generation) for call in calls_of(rollout))
    # GRPO: the scripted model answers every rollout of a group alike (no reward spread, which curation
    # drops), so each rollout is made a group of its own; the trainer's sequences are what its loss sees.
    for rollout in rollouts:
        [group] = sequences_of([to_groups(rollout["group_id"], [rollout])])
        assert len(group) == segments and {seq.rollout for seq in group} == {0}  # its segments weigh as one rollout
        pairs = Counter((t, "constrained" if math.isnan(lp) else lp) for seq in group
                        for t, m, lp in zip(seq.completion_ids, seq.loss_mask, seq.sampling_logprobs) if m)
        # The tokens a grammar forced (the call's opening under the first turn's tool_choice: required,
        # flagged generation_forced) are left out of the loss; every sampled one is in it once.
        calls = calls_of(rollout)
        assert any(any(call.forced or []) for call in calls)
        # A token sampled under the grammar has no sampling logprob for the trainer's ratio (NaN: it takes
        # π_old there, grpo_batch.behaviour_logprobs).
        assert pairs == Counter((t, "constrained" if c else lp) for call in calls for t, lp, f, c in
                                zip(call.generation, call.logprobs, call.forced or [0] * len(call.generation),
                                    call.constrained or [0] * len(call.generation)) if not f)


def test_the_compacting_agent_gives_a_segment_per_rewritten_history_and_each_trains(registry, tmp_path) -> None:
    rollouts = collect(registry, "compacting_agent")
    for rollout in rollouts:
        assert rollout["status"] == "ok" and rollout["reward"] == 1.0, rollout
        # The tool call, the summariser's call, then the answer from the compacted history.
        assert len(calls_of(rollout)) == 3 and rollout["prefix_ok"] is True
        first, summariser, compacted = rollout["sequences"]
        assert (first["conversation"], first["segment_reason"]) == (0, None)
        assert (summariser["conversation"], summariser["segment_reason"]) == (1, "new_conversation")
        assert (compacted["conversation"], compacted["segment_reason"]) == (0, "history_rewritten")
        summary = decode(summariser["completion_ids"])
        assert summary.startswith("You said: Summarise this conversation") and "get_weather" in summary
        prompt = decode(compacted["prompt_ids"])
        # The task, the summary in place of the history, the last turn (the tool call and its result) kept.
        assert f"<|im_start|>user\nSummary of the conversation so far: {summary}<|im_end|>" in prompt
        kept = prompt[prompt.index(summary) + len(summary):]
        city, (condition, degrees) = rollout["city"], CITIES[rollout["city"]]
        assert f"<tool_call>get_weather\n{{\"city\":\"{city}\"}}" in kept
        assert f"<|im_start|>tool\n{city}: {condition}, {degrees} C" in kept
    check_every_segment_trains(rollouts, 3)
    assert viewed_starts(rollouts, tmp_path) == [[(0, None, False), (1, "new_conversation", True),
                                                  (0, "history_rewritten", True)]] * len(rollouts)


def test_the_subagent_example_gives_a_conversation_per_agent_and_each_trains(registry, tmp_path) -> None:
    rollouts = collect(registry, "subagent")
    for rollout in rollouts:
        assert rollout["status"] == "ok" and rollout["reward"] == 1.0, rollout
        assert len(calls_of(rollout)) == 4 and rollout["prefix_ok"] is True
        main, sub = rollout["sequences"]
        assert (main["conversation"], main["segment_reason"]) == (0, None)
        assert (sub["conversation"], sub["segment_reason"]) == (1, "new_conversation")
        assert "ask_researcher" in decode(main["completion_ids"]) and "weather researcher" in decode(sub["prompt_ids"])
        # The sub-agent's answer is the main agent's tool result, between its two turns (mask 0).
        answer = decode(sampled_runs(sub["completion_ids"], sub["completion_mask"])[-1])
        assert rollout["city"] in answer and answer in decode(main["completion_ids"])
    check_every_segment_trains(rollouts, 2)
    assert viewed_starts(rollouts, tmp_path) == [[(0, None, False), (1, "new_conversation", True)]] * len(rollouts)
