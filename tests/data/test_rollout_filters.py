"""The degenerate-generation filters (Surogate's `filters[]`) against by-hand token sequences, and curation
counting and enforcing them."""

from __future__ import annotations

import math
from typing import Any

import pytest
from pydantic import TypeAdapter, ValidationError

from rollgym.data.rollout_filters import GibberishFilter, RepetitionFilter, RolloutFilter, flagged_by
from rollgym.train.loop.curation import CurateConfig, curate


def sequence(ids: list[int], logprobs: list[float], mask: list[int] | None = None,
             forced: list[int] | None = None) -> dict[str, Any]:
    out = {"prompt_ids": [1, 2], "completion_ids": ids, "completion_mask": mask or [1] * len(ids),
           "completion_logprobs": logprobs}
    if forced is not None:
        out["completion_forced"] = forced
    return out


def test_repetition_flags_a_run_of_window_sampled_tokens_above_the_threshold() -> None:
    # log(0.9) = -0.1054: -0.01 and -0.1 are above it, -0.5 is not.
    rule = RepetitionFilter(type="repetition", window=3, prob_threshold=0.9)
    assert rule.flags(sequence([5] * 6, [-0.01, -0.1, -0.5, -0.01, -0.01, -0.01]))  # tokens 4..6
    assert not rule.flags(sequence([5] * 6, [-0.01, -0.1, -0.5, -0.01, -0.11, -0.01]))  # -0.11 breaks the run
    # An environment token or a grammar-forced one is not sampled: it ends the run.
    assert not rule.flags(sequence([5] * 6, [-0.01, -0.1, -0.5, -0.01, 0.0, -0.01], mask=[1, 1, 1, 1, 0, 1]))
    assert not rule.flags(sequence([5] * 6, [-0.01, -0.1, -0.5, -0.01, 0.0, -0.01], forced=[0, 0, 0, 0, 1, 0]))
    assert not RepetitionFilter(type="repetition", window=4, prob_threshold=0.9).flags(
        sequence([5] * 6, [-0.01, -0.1, -0.5, -0.01, -0.01, -0.01]))
    assert RepetitionFilter(type="repetition").window == 3000 and RepetitionFilter(type="repetition").prob_threshold == 0.99


def test_gibberish_flags_a_rare_token_sampled_below_the_uniform_logprob_less_the_offset() -> None:
    rule = GibberishFilter(type="gibberish", vocab_size=1000, token_id_threshold=500, logprob_offset=2.0)
    floor = -math.log(1000) - 2.0  # -8.908
    assert rule.flags(sequence([10, 700], [-1.0, floor - 0.1]))
    assert not rule.flags(sequence([10, 700], [-1.0, floor + 0.1]))  # likely enough
    assert not rule.flags(sequence([10, 500], [-1.0, -12.0]))  # not above the id threshold
    assert not rule.flags(sequence([10, 700], [-1.0, -12.0], mask=[1, 0]))  # the environment's token
    defaults = GibberishFilter(type="gibberish", vocab_size=151936)
    assert (defaults.token_id_threshold, defaults.logprob_offset, defaults.enforce) == (100000, 2.0, False)


def test_a_filter_list_is_read_by_type_and_names_what_is_wrong() -> None:
    read = TypeAdapter(list[RolloutFilter]).validate_python(
        [{"type": "repetition", "window": 2}, {"type": "gibberish", "vocab_size": 1000, "token_id_threshold": 500, "enforce": True}])
    assert [type(each) for each in read] == [RepetitionFilter, GibberishFilter]
    with pytest.raises(ValidationError, match="vocab_size"):
        TypeAdapter(list[RolloutFilter]).validate_python([{"type": "gibberish"}])
    with pytest.raises(ValidationError, match="windw"):
        TypeAdapter(list[RolloutFilter]).validate_python([{"type": "repetition", "windw": 2}])
    assert flagged_by(read, [sequence([700, 5, 5], [-20.0, -0.001, -0.001])]) == read


REPEATING = [-0.001] * 4
NORMAL = [-1.0, -2.0, -0.5, -1.5]


def rollout(index: int, reward: float, logprobs: list[float]) -> dict[str, Any]:
    return {"rollout_id": f"g-r{index}", "group_id": "g", "reward": reward, "status": "ok",
            "responses_create_params": {"input": [{"role": "user", "content": "count"}]},
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}],
            "sequences": [sequence([7, 7, 7, 7], logprobs)], "prefix_ok": True}


def rows() -> list[dict[str, Any]]:  # rollout 0 loops with near certainty
    return [rollout(0, 1.0, REPEATING), rollout(1, 0.0, NORMAL), rollout(2, 1.0, NORMAL), rollout(3, 0.0, NORMAL)]


def test_curation_counts_flags_and_drops_only_what_an_enforced_filter_flags() -> None:
    counted = CurateConfig(filters=[{"type": "repetition", "window": 4}])
    result = curate(rows(), "sft", counted)
    assert result.summary()["flagged"] == {"repetition": 1} and result.summary()["dropped"] == {}
    assert len(result.records) == 4
    enforced = CurateConfig(filters=[{"type": "repetition", "window": 4, "enforce": True}])
    result = curate(rows(), "sft", enforced)
    assert result.summary()["dropped"] == {"repetition": 1} and result.rollouts_kept == 3
    assert [r["rollout_id"] for r in result.records] == ["g-r1", "g-r2", "g-r3"]


def test_a_groups_advantages_count_the_flagged_rollout_that_is_not_trained() -> None:
    enforced = CurateConfig(filters=[{"type": "repetition", "window": 4, "enforce": True}])
    result = curate(rows(), "groups", enforced, group_size=4)
    [record] = result.records
    # Rewards 1, 0, 1, 0: normalised advantages +1, -1, +1, -1 over all four; rollout 0 is left out.
    assert [m["rollout_id"] for m in record["rollouts"]] == ["g-r1", "g-r2", "g-r3"]
    assert [m["advantage"] for m in record["rollouts"]] == pytest.approx([-1, 1, -1], abs=1e-4)
    assert result.summary()["dropped"] == {"repetition": 1} and result.rollouts_kept == 3
    assert result.summary()["flagged"] == {"repetition": 1}
