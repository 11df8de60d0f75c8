"""Curation: filters in order, every dropped rollout counted by reason, RL data without token ids or
logprobs refused, and the three transforms over real rollout lines' shape."""

from __future__ import annotations

from typing import Any

import pytest

from rollgym.data.curriculum import CurriculumConfig
from rollgym.data.records import model_versions
from rollgym.train.loop.curation import CurateConfig, CurationError, curate, on_policy


def rollout(group: str, index: int, reward: float | None, *, version: str = "policy-e001", tokens: bool = True,
            logprobs: bool = True, tool_output: str = "Paris: sunny, 22 C", prompt: list[int] | None = None) -> dict[str, Any]:
    prompt_ids = prompt or [1, 2, 3, len(group)]
    completion = [10 + index, 11, 12]
    sequence = {"prompt_ids": prompt_ids, "completion_ids": completion, "completion_mask": [1, 0, 1],
                "completion_logprobs": [-0.5, 0.0, -0.25] if logprobs else None}
    return {
        "rollout_id": f"{group}-r{index}", "group_id": group, "reward": reward, "status": "ok",
        "responses_create_params": {"input": [{"role": "user", "content": f"weather in {group}?"}]},
        "response": {"model": version, "output": [
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": tool_output},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": f"answer {index}"}]},
        ]},
        "sequences": [sequence] if tokens else None, "prefix_ok": True if tokens else None,
    }


def group(name: str, rewards: list[float | None], **kwargs: Any) -> list[dict[str, Any]]:
    return [rollout(name, i, r, **kwargs) for i, r in enumerate(rewards)]


def test_model_versions_of_every_turn() -> None:
    row = rollout("g", 0, 1.0)
    assert model_versions(row) == {"policy-e001"}  # a server without model_version: the served model's name
    assert on_policy(row, "policy-e001") and not on_policy(row, "policy-e002")
    row["response"]["output"][0]["model_version"] = "e3@1"
    row["response"]["output"][-1]["model_version"] = "e3@1"
    assert model_versions(row) == {"e3@1"} and on_policy(row, "e3") and on_policy(row, "e3@1")
    # The adapter changed between the tool call and the answer: the rollout is stale.
    row["response"]["output"][-1]["model_version"] = "e4@2"
    assert not on_policy(row, "e3") and not on_policy(row, "e4")


def test_stale_failed_and_tokenless_rollouts_are_dropped_and_counted() -> None:
    rows = (group("a", [1.0, 0.0, 1.0, 0.0]) + [rollout("b", 0, 1.0, version="policy-e000")]
            + [rollout("b", 1, None), rollout("b", 2, 0.5, tokens=False), rollout("b", 3, 0.5, logprobs=False)])
    result = curate(rows, "groups", CurateConfig(), version="policy-e001", group_size=4)
    assert result.summary()["dropped"] == {"failed": 1, "no_logprobs": 1, "no_token_ids": 1, "stale": 1}
    assert [g["group_id"] for g in result.records] == ["a"]
    assert result.rollouts_in == 8 and result.rollouts_kept == 4
    [record] = result.records
    assert [r["advantage"] for r in record["rollouts"]] == pytest.approx([1, -1, 1, -1], abs=1e-4)
    assert record["rollouts"][0]["sequence"]["completion_logprobs"] == [-0.5, 0.0, -0.25]


def test_rl_stage_refuses_data_without_logprobs() -> None:
    rows = group("a", [1.0, 0.0], logprobs=False) + group("b", [1.0, 0.0], tokens=False)
    with pytest.raises(CurationError, match=r"grpo: none of the 4 rollouts carries token ids and sampling logprobs "
                                            r"\(no_logprobs: 2, no_token_ids: 2\)"):
        curate(rows, "groups", CurateConfig(), stage="grpo")


def test_groups_need_spread_and_full_size() -> None:
    rows = group("flat", [1.0, 1.0, 1.0]) + group("short", [1.0, 0.0]) + group("ok", [1.0, 0.0, 0.5])
    result = curate(rows, "groups", CurateConfig(), group_size=3)
    assert [g["group_id"] for g in result.records] == ["ok"]
    assert result.dropped == {"incomplete_group": 2, "zero_reward_spread": 3}


def test_sft_filters_in_order() -> None:
    rows = (group("a", [1.0, 1.0, 0.0, 1.0]) + group("b", [0.0, 0.0])
            + group("c", [1.0, 0.5], tool_output="Error: invalid arguments for get_weather: city")
            + group("d", [1.0, 1.0], prompt=[1, 2, 3, 1]))  # same prompt tokens as group a
    config = CurateConfig(min_reward=1.0, tool_success_only=True, top_k_per_group=2, dedupe_prompts=True)
    result = curate(rows, "sft", config)
    assert [r["rollout_id"] for r in result.records] == ["a-r0", "a-r1"]
    assert result.dropped == {"tool_error": 2, "below_min_reward": 3, "not_top_k": 1, "duplicate_prompt": 2}
    record = result.records[0]
    assert record["prompt_ids"] == [1, 2, 3, 1] and record["completion_mask"] == [1, 0, 1]
    assert record["messages"][0] == {"role": "user", "content": "weather in a?"}
    assert record["messages"][-1]["role"] == "assistant"


def test_min_reward_spread_and_curriculum_per_epoch() -> None:
    rows = group("easy", [1.0, 0.5]) + group("mid", [0.5, 0.0]) + group("hard", [0.25, 0.0]) + group("flat", [0.5, 0.5])
    curriculum = CurriculumConfig(initial_percentile=0.34, increment_percentile=0.34, expansion_interval=1,
                                  min_reward_diff=0)
    first = curate(rows, "groups", CurateConfig(curriculum=curriculum, min_reward_spread=0.3), epoch=0)
    assert [g["group_id"] for g in first.records] == ["easy"]
    assert first.dropped == {"curriculum": 4, "low_reward_spread": 2}  # easiest 2 of 4: easy and flat
    later = curate(rows, "groups", CurateConfig(curriculum=curriculum, min_reward_spread=0.3), epoch=2)
    assert [g["group_id"] for g in later.records] == ["easy", "mid"]
    assert later.dropped == {"low_reward_spread": 4}  # all 4 admitted; flat and hard spread < 0.3


def test_preferences_pair_exact_tokens() -> None:
    rows = group("a", [1.0, 0.0, 0.5, 0.45])
    result = curate(rows, "preferences", CurateConfig(min_pair_diff=0.1))
    [pair] = result.records
    assert (pair["chosen_rollout_id"], pair["rejected_rollout_id"]) == ("a-r0", "a-r1")
    assert pair["prompt_ids"] == [1, 2, 3, 1] and pair["chosen_ids"] == [10, 11, 12] and pair["rejected_ids"] == [11, 11, 12]
    assert pair["chosen_mask"] == pair["rejected_mask"] == [1, 0, 1]  # the environment's token is out of the loss
    assert result.dropped == {"unpaired": 2}


def test_groups_carry_the_advantages_the_trainer_uses_and_what_was_sampled() -> None:
    from rollgym.data.advantages import AdvantageConfig

    rows = group("a", [1.0, 0.0, 0.0, 1.0])
    rows[0]["response"]["output"][0].update(sampling={"temperature": 0.7, "top_p": 1.0, "logprobs": "processed"})
    [record] = curate(rows, "groups", CurateConfig(advantage=AdvantageConfig(type="rloo")), group_size=4).records
    assert [m["advantage"] for m in record["rollouts"]] == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    assert record["rollouts"][0]["sampling"]["temperature"] == 0.7
    # A rollout without a server's record: the request's temperature, logprobs of unknown kind.
    assert record["rollouts"][1]["sampling"] == {"temperature": 1.0, "top_p": 1.0, "logprobs": "unknown"}
    # A batch whose advantages the orchestrator computed keeps them: no second computation.
    for row, value in zip(rows, [0.3, -0.1, -0.1, -0.1]):
        row["advantage"] = value
    [kept] = curate(rows, "groups", CurateConfig(), group_size=4, keep_advantages=True).records
    assert [m["advantage"] for m in kept["rollouts"]] == [0.3, -0.1, -0.1, -0.1]
    [default] = curate(rows, "groups", CurateConfig(), group_size=4).records
    assert [m["advantage"] for m in default["rollouts"]] == pytest.approx([1, -1, -1, 1], abs=1e-5)


# --- rollouts with several segments ---------------------------------------------------------------------


def segmented(group: str, index: int, reward: float, turns: int) -> dict[str, Any]:
    """A rollout of `turns` user turns whose template drops each turn's reasoning at the next one: merged by
    the real `merge_sequences` into one segment per turn."""
    from rollgym.sequences import merge_sequences

    items, history = [], [1, 2, 3]
    for turn in range(turns):
        if turn:
            history = history + [4, 5]
        reasoning, answer = [20, 10 + turn, 21], [30 + turn, 39]
        items.append({"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "a"}],
                      "prompt_token_ids": list(history), "generation_token_ids": reasoning + answer,
                      "generation_log_probs": [-0.1 * (k + 1) for k in range(5)]})
        history = history + answer
    sequences, prefix_ok = merge_sequences(items)
    row = rollout(group, index, reward)
    row["response"]["output"] = items
    row.update(sequences=sequences, prefix_ok=prefix_ok)
    return row


@pytest.mark.parametrize("mode, records, segments, left_out, broken", [
    ("all", 6, 6, 0, 0), ("last", 3, 3, 3, 0), ("drop", 1, 1, 0, 2)])
def test_segments_all_last_drop(mode, records, segments, left_out, broken) -> None:
    rows = [segmented("g", 0, 1.0, 3), segmented("g", 1, 0.0, 2), segmented("g", 2, 0.5, 1)]
    assert [len(r["sequences"]) for r in rows] == [3, 2, 1]
    curated = curate(rows, "sft", CurateConfig(segments=mode))
    summary = curated.summary()
    assert summary["records"] == records and summary["segments"] == segments
    assert summary["segments_left_out"] == left_out and summary["dropped_prefix_broken"] == broken
    assert summary["rollouts_kept"] == 3 - broken
    assert summary["segments_per_rollout"] == pytest.approx(segments / (3 - broken), abs=1e-3)
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for record in curated.records:
        by_rollout.setdefault(record["rollout_id"], []).append(record)
    source = {r["rollout_id"]: r for r in rows}
    for rollout_id, mine in by_rollout.items():
        sequences = source[rollout_id]["sequences"]
        if len(sequences) == 1:
            assert "segment" not in mine[0] and mine[0]["completion_ids"] == sequences[0]["completion_ids"]
            continue
        expected = list(range(len(sequences))) if mode == "all" else [len(sequences) - 1]
        assert [r["segment"] for r in mine] == expected
        assert [r["completion_ids"] for r in mine] == [sequences[i]["completion_ids"] for i in expected]


def test_groups_keep_every_segment_and_preferences_pair_the_first() -> None:
    rows = [segmented("g", 0, 1.0, 3), segmented("g", 1, 0.0, 2)]
    [record] = curate(rows, "groups", CurateConfig(), group_size=2).records
    first, second = record["rollouts"]
    assert [s["completion_ids"] for s in first["sequences"]] == [s["completion_ids"] for s in rows[0]["sequences"]]
    assert [s["segment"] for s in second["sequences"]] == [0, 1] and second["sequence"]["segment"] == 1
    with pytest.raises(CurationError, match="has several segments .* curate.segments is drop"):  # nothing left
        curate(rows, "groups", CurateConfig(segments="drop"), group_size=2)
    curated = curate(rows, "preferences", CurateConfig())
    [pair] = curated.records
    assert pair["prompt_ids"] == rows[0]["sequences"][0]["prompt_ids"]
    assert pair["chosen_ids"] == rows[0]["sequences"][0]["completion_ids"]
    assert pair["rejected_ids"] == rows[1]["sequences"][0]["completion_ids"]
    assert curated.summary()["segments"] == 2 and curated.summary()["segments_left_out"] == 3


def test_a_segment_without_logprobs_drops_its_rollout() -> None:
    row = segmented("g", 0, 1.0, 2)
    row["sequences"][1]["completion_logprobs"][0] = None
    other = segmented("g", 1, 0.0, 1)
    assert curate([row, other], "sft", CurateConfig()).dropped == {"no_logprobs": 1}
    assert curate([row, other], "sft", CurateConfig(segments="last")).dropped == {"no_logprobs": 1}
    # Only the last segment trains under `last`: the first one's logprobs are not needed.
    row["sequences"][0]["completion_logprobs"][0] = None
    row["sequences"][1]["completion_logprobs"][0] = -0.1
    assert len(curate([row], "sft", CurateConfig(segments="last")).records) == 1
    assert curate([row, other], "sft", CurateConfig()).dropped == {"no_logprobs": 1}
