"""Group advantages for GRPO-style training: how much better each rollout did than its group.

Built-in kinds (`AdvantageConfig.type`):

- `mean`: `r_i - mean(r)` (Dr. GRPO: no division by the spread);
- `normalized`: `(r_i - mean(r)) / (std(r) + epsilon)` (group-normalised, as in GRPO);
- `rloo`: `r_i - mean_{j≠i}(r_j)` (REINFORCE leave-one-out: the baseline excludes the rollout itself);
- `length_weighted`: `r_i - sum(len_j * r_j) / sum(len_j)`: the baseline is the token-weighted mean,
  so a long rollout moves the baseline more than a short one;
- `custom`: the function at `import_path` (`package.module:function`), called as
  `function(rewards, lengths, **kwargs)` and returning one float per rollout;
- `return_to_go` (turn-level credit, `rollout_advantages`): one advantage per model turn. A rollout's
  model turns are its model calls (the output items that carry a call's tokens), k = 1..K. Turn k's
  reward r_k is its shaped reward plus, at the last turn, the rollout's `reward` (the outcome):
  the shaped rewards are the rollout's `step_rewards` (what `/verify` answered, one per model turn)
  when it has them, else the sum of the `reward`s the environment gave the tool calls of turn k
  (on their `function_call_output` items), else 0. The return-to-go is G_k = Σ_{j≥k} γ^(j−k)·r_j
  (`gamma`), and the advantage of turn k of rollout i is (G_ik − mean(G)) / (std(G) + epsilon), the
  mean and population std over every model turn of every rollout of the group (pooled). With no
  shaped rewards, γ = 1 and equally many turns per rollout, every turn of a rollout has the
  `normalized` advantage of its reward.

`lengths` are the completion tokens the policy generated (`records.completion_length`: the model-token
count of the rollout's `sequences`, else its `metrics.output_tokens`, else 0).

This is the one advantage computation: the curation of `rollgym train`, the orchestrator's batches,
`rollgym export --format grpo` and the viewer all call `group_advantages` (the last two through
`grpo_advantages`, GRPO's normalised advantage beside the mean-only one).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sequences import token_record
from .records import completion_length


AdvantageFunction = Callable[..., Sequence[float]]


class AdvantageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["mean", "normalized", "rloo", "length_weighted", "custom", "return_to_go"] = "normalized"
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="return_to_go only: the discount per model turn")
    import_path: str | None = Field(default=None, description="custom only: 'package.module:function'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="custom only: passed to the function")
    epsilon: float = Field(default=1e-6, gt=0, description="normalized only: added to the group's std")

    @model_validator(mode="after")
    def _custom_needs_path(self) -> "AdvantageConfig":
        if self.type != "return_to_go" and "gamma" in self.model_fields_set and self.gamma != 1.0:
            raise ValueError(f"gamma is a setting of type: return_to_go, not {self.type}")
        if (self.type == "custom") != (self.import_path is not None):
            raise ValueError("import_path is required with type: custom, and only with it")
        if self.import_path is not None:
            load_function(self.import_path)  # fail at config time, not at the first batch
        return self


def load_function(import_path: str) -> AdvantageFunction:
    """The callable at `package.module:function` (or `package.module.function`)."""
    module_name, _, attribute = import_path.partition(":") if ":" in import_path else import_path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"import_path {import_path!r}: expected 'package.module:function'")
    from ..config import import_target  # omegaconf and yaml only for a custom advantage

    try:
        return import_target(f"{module_name}:{attribute}")
    except ValueError as exc:
        raise ValueError(f"import_path: {exc}") from None


def reward_statistics(rewards: Sequence[float]) -> tuple[float, float]:
    """A group's mean reward and its population standard deviation (exactly rounded sums)."""
    mean = math.fsum(rewards) / len(rewards)
    return mean, math.sqrt(math.fsum((r - mean) ** 2 for r in rewards) / len(rewards))


def group_advantages(rewards: Sequence[float], lengths: Sequence[int], config: AdvantageConfig) -> list[float]:
    """One advantage per rollout of a group, in order."""
    if len(rewards) != len(lengths):
        raise ValueError(f"{len(rewards)} rewards for {len(lengths)} lengths")
    if not rewards:
        return []
    if config.type == "return_to_go":
        raise ValueError("advantage type return_to_go needs each rollout's turns: call rollout_advantages")
    mean, std = reward_statistics(rewards)
    if config.type == "mean":
        return [r - mean for r in rewards]
    if config.type == "rloo":
        if len(rewards) < 2:
            return [0.0]
        total = sum(rewards)
        return [r - (total - r) / (len(rewards) - 1) for r in rewards]
    if config.type == "normalized":
        return [(r - mean) / (std + config.epsilon) for r in rewards]
    if config.type == "length_weighted":
        total = sum(lengths)
        baseline = sum(n * r for n, r in zip(lengths, rewards)) / total if total else mean
        return [r - baseline for r in rewards]
    assert config.import_path is not None
    values = list(load_function(config.import_path)(list(rewards), list(lengths), **config.kwargs))
    if len(values) != len(rewards) or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
        raise ValueError(f"advantage function {config.import_path!r} must return {len(rewards)} finite numbers, "
                         f"got {values!r}")
    return [float(v) for v in values]


def turn_rewards(rollout: Mapping[str, Any]) -> list[float]:
    """r_1..r_K of a rollout's model turns (see `return_to_go` above): shaped rewards, the outcome added
    at the last turn. A rollout without model calls is one turn."""
    turns = 0
    from_tools: list[float] = []
    for item in (rollout.get("response") or {}).get("output") or []:
        if token_record(item) is not None:
            turns += 1
            from_tools.append(0.0)
        elif isinstance(item, Mapping) and item.get("type") == "function_call_output" and turns \
                and item.get("reward") is not None:
            from_tools[-1] += float(item["reward"])
    turns = max(turns, 1)
    shaped = rollout.get("step_rewards")
    if shaped is not None:
        if not isinstance(shaped, list) or len(shaped) != turns:
            raise ValueError(f"rollout {rollout.get('rollout_id')}: step_rewards must hold one number per model "
                             f"turn ({turns}), got {shaped!r}")
        rewards = [float(x) for x in shaped]
    else:
        rewards = from_tools or [0.0]
    rewards[-1] += float(rollout["reward"])
    return rewards


def returns_to_go(rewards: Sequence[float], gamma: float) -> list[float]:
    """G_k = Σ_{j≥k} γ^(j−k)·r_j for every k."""
    out, running = [0.0] * len(rewards), 0.0
    for k in range(len(rewards) - 1, -1, -1):
        running = rewards[k] + gamma * running
        out[k] = running
    return out


def rollout_advantages(rollouts: Sequence[Mapping[str, Any]], config: AdvantageConfig
                       ) -> tuple[list[float], list[list[float]] | None]:
    """A group's advantages under `config`: (one per rollout, and for `return_to_go` one per model turn
    of each rollout, else None). Under `return_to_go` a rollout's one value is its first turn's."""
    if config.type != "return_to_go":
        return group_advantages([float(r["reward"]) for r in rollouts], [completion_length(r) for r in rollouts],
                                config), None
    returns = [returns_to_go(turn_rewards(r), config.gamma) for r in rollouts]
    mean, std = reward_statistics([g for turns in returns for g in turns]) if returns else (0.0, 0.0)
    per_turn = [[(g - mean) / (std + config.epsilon) for g in turns] for turns in returns]
    return [turns[0] for turns in per_turn], per_turn


def model_turns(completion_mask: Sequence[int]) -> int:
    """The model turns in a token sequence: its runs of completion_mask 1 (environment tokens, 0, part them)."""
    return sum(1 for k, bit in enumerate(completion_mask) if bit and (k == 0 or not completion_mask[k - 1]))


def segment_turn_advantages(sequences: Sequence[Mapping[str, Any]], turn_advantages: Sequence[float],
                            where: str = "a rollout") -> list[list[float]]:
    """Per token sequence of a rollout (all of its `sequences`, in order), the advantages of the model turns
    it holds, turn by turn."""
    counts = [model_turns(s["completion_mask"]) for s in sequences]
    if sum(counts) != len(turn_advantages):
        raise ValueError(f"{where}: {sum(counts)} model turns in its token sequences, but {len(turn_advantages)} "
                         "model calls (a call that generated no token, or two calls with no token between them)")
    starts = [sum(counts[:i]) for i in range(len(counts))]
    return [list(turn_advantages[start:start + n]) for start, n in zip(starts, counts)]


def token_advantages(completion_mask: Sequence[int], turn_advantages: Sequence[float]) -> list[float]:
    """Per token of a sequence, the advantage of the model turn it belongs to (0 for environment tokens,
    which are out of the loss); `turn_advantages` holds one per model turn of this sequence."""
    if model_turns(completion_mask) != len(turn_advantages):
        raise ValueError(f"{model_turns(completion_mask)} model turns in the sequence for {len(turn_advantages)} "
                         "turn advantages")
    out, turn = [], -1
    for k, bit in enumerate(completion_mask):
        if bit and (k == 0 or not completion_mask[k - 1]):
            turn += 1
        out.append(float(turn_advantages[turn]) if bit else 0.0)
    return out


def with_turn_advantages(rollout: Mapping[str, Any], segments: list[dict[str, Any]],
                         turn_advantages: Sequence[float] | None) -> list[dict[str, Any]]:
    """The segments a rollout trains on, each with the `turn_advantages` of its model turns (its `segment`
    index places it among the rollout's `sequences`); unchanged without turn advantages."""
    if turn_advantages is None:
        return segments
    where = f"rollout {rollout.get('rollout_id')}"
    per_sequence = segment_turn_advantages(rollout["sequences"], turn_advantages, where)
    return [{**s, "turn_advantages": per_sequence[s.get("segment", 0)]} for s in segments]


_NORMALIZED = AdvantageConfig(type="normalized")
_MEAN = AdvantageConfig(type="mean")


def grpo_advantages(rewards: Sequence[float], epsilon: float = _NORMALIZED.epsilon
                    ) -> tuple[float, float, list[float], list[float]]:
    """(mean, population std, GRPO's normalised advantage per reward, the mean-only one per reward): what
    `rollgym export --format grpo` writes and the viewer shows for a group."""
    normalized = _NORMALIZED if epsilon == _NORMALIZED.epsilon else AdvantageConfig(type="normalized", epsilon=epsilon)
    lengths = [0] * len(rewards)
    return (*reward_statistics(rewards), group_advantages(rewards, lengths, normalized),
            group_advantages(rewards, lengths, _MEAN))


__all__ = ["AdvantageConfig", "group_advantages", "grpo_advantages", "load_function", "returns_to_go",
           "model_turns", "reward_statistics", "rollout_advantages", "segment_turn_advantages", "token_advantages",
           "turn_rewards", "with_turn_advantages"]
