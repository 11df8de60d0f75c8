"""Rollouts whose generations went on across weight updates (in-flight updates): their items record which
version sampled which tokens (`model_version_spans`), and from there the merged sequences, the orchestrator's
staleness (a rollout is as old as its oldest token), each step's token-level metrics, and the GRPO trainer's
inputs (each token with its own sampling logprob) follow them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rollgym.data.records import model_versions
from rollgym.schema import RunResponse
from rollgym.sequences import merge_sequences
from rollgym.train.loop.curation import CurateConfig, curate
from rollgym.train.orchestrator.config import OrchestratorConfig
from rollgym.train.orchestrator.groups import Group, annotate, drop_reason
from rollgym.train.orchestrator.metrics import token_staleness
from rollgym.train.orchestrator.policy_versions import PolicyVersions
from rollgym.train.orchestrator.sources import SourceTask
from rollgym.train.trainers.grpo_batch import sequences_of

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "logprobs": "processed"}


def item(prompt: list[int], generation: list[int], version: str, spans: list[tuple[str, int]] | None = None,
         call: bool = False) -> dict[str, Any]:
    """A generated item with its call's tokens; logprobs -(position + 1) / 100, so each is recognisable."""
    fields = {"prompt_token_ids": prompt, "generation_token_ids": generation,
              "generation_log_probs": [-(i + 1) / 100 for i in range(len(generation))], "model_version": version,
              "sampling": SAMPLING}
    if spans is not None:
        fields["model_version_spans"] = [{"model_version": v, "tokens": n} for v, n in spans]
    if call:
        return {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
                "arguments": "{}", "status": "completed", **fields}
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "x", "annotations": []}], **fields}


def rollout(reward: float, items: list[dict[str, Any]], rollout_id: str) -> dict[str, Any]:
    sequences, prefix_ok = merge_sequences(items)
    answer = {"responses_create_params": {"input": "q"}, "rollout_id": rollout_id, "group_id": "g", "reward": reward,
              "status": "ok", "sequences": sequences, "prefix_ok": prefix_ok,
              "response": {"id": "resp_1", "object": "response", "created_at": 0, "model": "policy",
                           "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "output": items,
                           "model_version": items[-1]["model_version"]}}
    RunResponse.model_validate(answer)  # the /run answer's schema takes the spans
    return answer


def two_turns(reward: float, rollout_id: str) -> dict[str, Any]:
    """Turn 1 sampled by v1; turn 2 begun by v1, aborted by the update to v3 after 3 tokens, continued by v3."""
    first = item([1, 2, 3], [10, 11], "v1", call=True)
    second = item([1, 2, 3, 10, 11, 50, 51], [20, 21, 22, 23, 24], "v3", spans=[("v1", 3), ("v3", 2)])
    return rollout(reward, [first, second], rollout_id)


def test_spans_go_into_the_merged_sequence_token_by_token():
    answer = two_turns(1.0, "r0")
    sequence = answer["sequences"][0]
    assert sequence["completion_ids"] == [10, 11, 50, 51, 20, 21, 22, 23, 24]
    assert sequence["completion_version_spans"] == [
        {"model_version": "v1", "tokens": 2}, {"model_version": None, "tokens": 2},
        {"model_version": "v1", "tokens": 3}, {"model_version": "v3", "tokens": 2}]
    assert sum(span["tokens"] for span in sequence["completion_version_spans"]) == len(sequence["completion_ids"])
    assert sequence["model_versions"] == ["v1", "v3"]  # unchanged: one per call, the version of its last token
    assert model_versions(answer) == {"v1", "v3"}
    # A rollout without spans merges as before: no new key.
    plain, _ = merge_sequences([item([1, 2, 3], [10, 11], "v1")])
    assert "completion_version_spans" not in plain[0]


def test_spans_that_do_not_cover_the_generation_are_not_used():
    bad = item([1, 2], [5, 6, 7], "v2", spans=[("v1", 1), ("v2", 1)])
    sequences, _ = merge_sequences([bad])
    assert "completion_version_spans" not in sequences[0]


def test_staleness_counts_the_oldest_token_and_the_step_counts_tokens_by_lag(tmp_path: Path):
    versions = PolicyVersions({}, [], "policy")
    versions.steps.update({"v1": 1, "v2": 2, "v3": 3})
    mixed, fresh = two_turns(1.0, "r0"), rollout(0.0, [item([1, 2, 3], [10, 11, 12, 13], "v3")], "r1")
    # The item says v3 (its last token), but three of its tokens are v1's: the rollout is as old as v1.
    assert versions.sampled_step(mixed, fallback=9) == 1
    assert versions.sampled_tokens(mixed, fallback=9) == {1: 5, 3: 2}
    assert versions.sampled_tokens(fresh, fallback=9) == {3: 4}
    (tmp_path / "t.jsonl").write_text("{}\n")
    group = Group("env", SourceTask("env", "g", {}), "g-d1", tag=4, dispatch_version=3, rollouts=[mixed, fresh],
                  sampled=[versions.sampled_step(r, 3) for r in (mixed, fresh)],
                  token_steps=[versions.sampled_tokens(r, 3) for r in (mixed, fresh)])
    config = OrchestratorConfig(batch_size=2, rollouts_per_example=2, max_async_level=1, max_off_policy_steps=1,
                                envs=[{"name": "env", "input": str(tmp_path / "t.jsonl")}])
    # Batch 4 trains policy 3: the v1 tokens lag it by 2 > max_off_policy_steps, so the whole group is stale
    # (judged by its last tokens, v3, it would have passed).
    assert drop_reason(group, 4, config) == "stale"
    relaxed = config.model_copy(update={"max_off_policy_steps": 2})
    assert drop_reason(group, 4, relaxed) is None
    annotated = annotate(4, [group], relaxed)
    assert [(r["policy_lag"], r["token_lags"]) for r in annotated] == [(2, {"0": 2, "2": 5}), (0, {"0": 4})]
    assert token_staleness(annotated) == {"policy_lag_mean": 1.0, "policy_lag_max": 2,
                                          "token_staleness": {"0": 6, "2": 5},
                                          "off_policy_token_share": round(5 / 11, 4), "mixed_version_rollouts": 1}


def test_the_trainer_takes_each_token_with_the_logprob_of_the_version_that_sampled_it():
    batch = [two_turns(1.0, "r0"), two_turns(0.0, "r1")]
    for member, advantage in zip(batch, (1.0, -1.0)):
        member["advantage"] = advantage
    curated = curate(batch, "groups", CurateConfig(), group_size=2, keep_advantages=True)
    assert len(curated.records) == 1
    (trained, _), = sequences_of(curated.records)
    second = batch[0]["response"]["output"][1]
    # The continued call's logprobs reach the loss token by token, across the span boundary (v1 | v3)
    # inside it: tokens 20, 21, 22 with v1's sampling logprobs, 23, 24 with v3's.
    at = trained.completion_ids.index(20)
    assert trained.completion_ids[at:] == second["generation_token_ids"]
    assert trained.sampling_logprobs[at:] == second["generation_log_probs"]
    assert trained.sampling_logprobs[:2] == batch[0]["response"]["output"][0]["generation_log_probs"]
    assert trained.loss_mask == [1, 1, 0, 0, 1, 1, 1, 1, 1]
    spans = batch[0]["sequences"][0]["completion_version_spans"]
    boundary = sum(span["tokens"] for span in spans[:3])
    assert Counter(span["model_version"] for span in spans for _ in range(span["tokens"]))["v3"] == 2
    assert trained.completion_ids[boundary:] == [23, 24]
