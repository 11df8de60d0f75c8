"""The one advantage computation (rollgym.data.advantages) and the rollout fields it reads
(rollgym.data.records): each kind against values worked out by hand, a custom function, bad configs."""

from __future__ import annotations

import pytest

from rollgym.data.advantages import AdvantageConfig, group_advantages, grpo_advantages
from rollgym.data.records import completion_length


def scaled_by_length(rewards, lengths, scale=1.0):
    """A custom advantage function for the import-path test."""
    return [scale * r * n for r, n in zip(rewards, lengths)]


def one_value(rewards, lengths):
    return [0.0]


def test_group_advantages():
    rewards, lengths = [1.0, 0.0, 0.0, 1.0], [10, 30, 30, 10]
    assert group_advantages(rewards, lengths, AdvantageConfig(type="mean")) == [0.5, -0.5, -0.5, 0.5]
    normalized = group_advantages(rewards, lengths, AdvantageConfig(type="normalized"))
    assert normalized == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    # The token-weighted baseline is 20/80 = 0.25: short right answers gain more than with the plain mean.
    assert group_advantages(rewards, lengths, AdvantageConfig(type="length_weighted")) == [0.75, -0.25, -0.25, 0.75]
    assert group_advantages([0.5, 0.5], [1, 1], AdvantageConfig()) == [0.0, 0.0]
    custom = AdvantageConfig(type="custom", import_path=f"{__name__}:scaled_by_length", kwargs={"scale": 2.0})
    assert group_advantages([1.0, 0.5], [3, 4], custom) == [6.0, 4.0]


def test_advantage_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="import_path is required with type: custom"):
        AdvantageConfig(type="custom")
    with pytest.raises(ValueError, match="No module named 'no_such_module'"):
        AdvantageConfig(type="custom", import_path="no_such_module:f")
    bad = AdvantageConfig(type="custom", import_path=f"{__name__}:one_value")
    with pytest.raises(ValueError, match="must return 2 finite numbers, got \\[0.0\\]"):
        group_advantages([1.0, 0.0], [1, 1], bad)


def test_completion_length_prefers_the_token_mask():
    # A rollout's `sequences` is a list (one sequence per unbroken token prefix), as /run returns it.
    real = {"sequences": [{"prompt_ids": [1], "completion_ids": [5, 6, 7, 8], "completion_mask": [1, 1, 0, 1],
                           "completion_logprobs": [-0.1, -0.2, 0.0, -0.3]}], "metrics": {"output_tokens": 9}}
    assert completion_length(real) == 3
    assert completion_length({**real, "sequences": real["sequences"] * 2}) == 6
    assert completion_length({"sequences": {"completion_mask": [1, 1, 0, 1]}, "metrics": {"output_tokens": 9}}) == 3
    assert completion_length({"metrics": {"output_tokens": 9}}) == 9
    assert completion_length({}) == 0


def test_rloo_baseline_leaves_the_rollout_out():
    advantages = group_advantages([1.0, 0.0, 0.0, 1.0], [1, 1, 1, 1], AdvantageConfig(type="rloo"))
    assert advantages == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])
    assert group_advantages([0.5], [3], AdvantageConfig(type="rloo")) == [0.0]


def test_grpo_advantages_are_the_normalized_and_mean_only_kinds():
    """What `rollgym export --format grpo` writes: (r - mean) / (std + eps) and r - mean, std over the group."""
    mean, std, normalized, centered = grpo_advantages([1.0, 0.0, 0.0, 0.0])
    assert mean == 0.25 and std == pytest.approx(0.4330127, abs=1e-7)  # sqrt(3)/4
    assert normalized == pytest.approx([0.75 / (std + 1e-6), -0.25 / (std + 1e-6), -0.25 / (std + 1e-6),
                                        -0.25 / (std + 1e-6)])
    assert centered == [0.75, -0.25, -0.25, -0.25]
    assert grpo_advantages([0.5, 0.5], epsilon=0.1)[2:] == ([0.0, 0.0], [0.0, 0.0])
