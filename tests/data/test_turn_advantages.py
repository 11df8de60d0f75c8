"""Turn-level credit (`advantage.type: return_to_go`, rollgym.data.advantages): per-turn rewards from tool
outputs or `step_rewards`, discounted returns-to-go, the group's pooled normalisation, and the mapping of
turn advantages onto a rollout's tokens and segments, each against numbers worked out by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest

from rollgym.data.advantages import (
    AdvantageConfig, group_advantages, model_turns, returns_to_go, rollout_advantages, segment_turn_advantages,
    token_advantages, turn_rewards, with_turn_advantages,
)


def call(k: int) -> dict[str, Any]:
    """The item carrying model call k's tokens."""
    return {"type": "function_call", "call_id": f"c{k}", "name": "step", "arguments": "{}",
            "prompt_token_ids": [1], "generation_token_ids": [2, 3], "generation_log_probs": [-0.1, -0.2]}


def rollout(reward: float, tool_rewards: list[list[float]], **extra: Any) -> dict[str, Any]:
    """A rollout whose turn k made one call per entry of tool_rewards[k] (None: no reward on its output),
    then a final answer turn."""
    output: list[dict[str, Any]] = []
    for k, rewards in enumerate(tool_rewards):
        output.append(call(k))
        for r in rewards:
            item = {"type": "function_call_output", "call_id": f"c{k}", "output": "ok"}
            output.append(item if r is None else {**item, "reward": r})
    output.append({"type": "message", "role": "assistant", "content": [], "prompt_token_ids": [1],
                   "generation_token_ids": [4], "generation_log_probs": [-0.3]})
    return {"rollout_id": "r", "reward": reward, "response": {"output": output}, **extra}


def test_turn_rewards_from_tool_outputs_and_the_outcome_at_the_last_turn() -> None:
    # Turn 1: two calls rewarded 0.25 and 0.5; turn 2: one call without a reward; turn 3: the answer.
    assert turn_rewards(rollout(1.0, [[0.25, 0.5], [None]])) == [0.75, 0.0, 1.0]
    assert turn_rewards(rollout(0.0, [])) == [0.0]  # one turn, the outcome only
    assert turn_rewards({"reward": 0.5, "response": {"output": []}}) == [0.5]  # no model call: one turn


def test_step_rewards_replace_the_tool_rewards_and_must_match_the_turns() -> None:
    assert turn_rewards(rollout(1.0, [[0.25], [0.5]], step_rewards=[0.1, 0.2, 0.3])) == [0.1, 0.2, 1.3]
    with pytest.raises(ValueError, match="rollout r: step_rewards must hold one number per model turn \\(3\\)"):
        turn_rewards(rollout(1.0, [[0.25], [0.5]], step_rewards=[0.1, 0.2]))


def test_returns_to_go_by_hand() -> None:
    assert returns_to_go([1.0, 0.0, 2.0], 0.5) == [1.0 + 0.5 * 0.0 + 0.25 * 2.0, 1.0, 2.0]
    assert returns_to_go([1.0, 0.0, 2.0], 1.0) == [3.0, 2.0, 2.0]
    assert returns_to_go([1.0, 0.0, 2.0], 0.0) == [1.0, 0.0, 2.0]


def test_a_group_is_normalised_over_every_turn_of_every_rollout() -> None:
    """Rollout a: turn rewards [0.5, 0, 1] → G (γ = 0.5) = [0.75, 0.5, 1]; rollout b: [0, 0] → [0, 0].
    Pooled G = {0.75, 0.5, 1, 0, 0}: mean 0.45, population std √0.155."""
    config = AdvantageConfig(type="return_to_go", gamma=0.5, epsilon=1e-6)
    a = rollout(1.0, [[0.5], [None]])
    b = rollout(0.0, [[None]])
    values, turns = rollout_advantages([a, b], config)
    std = math.sqrt(((0.75 - 0.45) ** 2 + 0.05 ** 2 + 0.55 ** 2 + 2 * 0.45 ** 2) / 5)
    assert [len(t) for t in turns] == [3, 2]
    assert turns[0] + turns[1] == pytest.approx([(g - 0.45) / (std + 1e-6) for g in (0.75, 0.5, 1.0, 0.0, 0.0)])
    assert values == pytest.approx([turns[0][0], turns[1][0]])  # a rollout's one value: its first turn's


def test_with_the_outcome_only_every_turn_has_the_normalized_advantage() -> None:
    """γ = 1, no shaped rewards, two turns each: G is the reward at every turn, and the pooled statistics
    are the group's (each reward counted twice), so the turns carry GRPO's normalised advantage."""
    rollouts = [rollout(r, [[None]]) for r in (1.0, 0.0, 0.5, 0.0)]
    values, turns = rollout_advantages(rollouts, AdvantageConfig(type="return_to_go"))
    normalized = group_advantages([1.0, 0.0, 0.5, 0.0], [0] * 4, AdvantageConfig())
    assert [x for t in turns for x in t] == pytest.approx([x for a in normalized for x in (a, a)])
    assert values == pytest.approx(normalized)
    # Any other type: one value per rollout and no turns.
    values, turns = rollout_advantages(rollouts, AdvantageConfig(type="mean"))
    assert turns is None and values == pytest.approx([0.625, -0.375, 0.125, -0.375])


def test_return_to_go_settings() -> None:
    with pytest.raises(ValueError, match="gamma is a setting of type: return_to_go, not normalized"):
        AdvantageConfig(gamma=0.9)
    with pytest.raises(ValueError, match="less than or equal to 1"):
        AdvantageConfig(type="return_to_go", gamma=1.5)
    with pytest.raises(ValueError, match="return_to_go needs each rollout's turns"):
        group_advantages([1.0, 0.0], [1, 1], AdvantageConfig(type="return_to_go"))


def test_turn_advantages_onto_tokens_and_segments() -> None:
    # Model tokens (1) in runs parted by environment tokens (0): three turns in the first sequence.
    mask = [1, 1, 0, 0, 1, 0, 1, 1, 1]
    assert model_turns(mask) == 3 and model_turns([0, 0]) == 0
    assert token_advantages(mask, [0.5, -1.0, 2.0]) == [0.5, 0.5, 0.0, 0.0, -1.0, 0.0, 2.0, 2.0, 2.0]
    with pytest.raises(ValueError, match="3 model turns in the sequence for 2 turn advantages"):
        token_advantages(mask, [0.5, -1.0])
    # A rollout of two segments: the second segment's first model run is the rollout's fourth turn.
    sequences = [{"completion_mask": mask}, {"completion_mask": [1, 0, 1]}]
    assert segment_turn_advantages(sequences, [1, 2, 3, 4, 5]) == [[1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="rollout x: 5 model turns in its token sequences, but 4 model calls"):
        segment_turn_advantages(sequences, [1, 2, 3, 4], "rollout x")
    # Training the last segment only (curate.segments: last): it gets its own turns' advantages.
    source = {"rollout_id": "x", "sequences": sequences}
    last = with_turn_advantages(source, [{**sequences[1], "segment": 1}], [1, 2, 3, 4, 5])
    assert last == [{"completion_mask": [1, 0, 1], "segment": 1, "turn_advantages": [4, 5]}]
    assert with_turn_advantages(source, [sequences[0]], None) == [sequences[0]]
