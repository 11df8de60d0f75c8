"""Group advantages for GRPO-style training: how much better each rollout did than its group.

Built-in kinds (`AdvantageConfig.type`):

- `mean`: `r_i - mean(r)` (Dr. GRPO: no division by the spread);
- `normalized`: `(r_i - mean(r)) / (std(r) + epsilon)` (group-normalised, as in GRPO);
- `rloo`: `r_i - mean_{j≠i}(r_j)` (REINFORCE leave-one-out: the baseline excludes the rollout itself);
- `length_weighted`: `r_i - sum(len_j * r_j) / sum(len_j)`: the baseline is the token-weighted mean,
  so a long rollout moves the baseline more than a short one;
- `custom`: the function at `import_path` (`package.module:function`), called as
  `function(rewards, lengths, **kwargs)` and returning one float per rollout.

`lengths` are the completion tokens the policy generated (`records.completion_length`: the model-token
count of the rollout's `sequences`, else its `metrics.output_tokens`, else 0).

This is the one advantage computation: the curation of `rollgym train`, the orchestrator's batches,
`rollgym export --format grpo` and the viewer all call `group_advantages` (the last two through
`grpo_advantages`, GRPO's normalised advantage beside the mean-only one).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator


AdvantageFunction = Callable[..., Sequence[float]]


class AdvantageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["mean", "normalized", "rloo", "length_weighted", "custom"] = "normalized"
    import_path: str | None = Field(default=None, description="custom only: 'package.module:function'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="custom only: passed to the function")
    epsilon: float = Field(default=1e-6, gt=0, description="normalized only: added to the group's std")

    @model_validator(mode="after")
    def _custom_needs_path(self) -> "AdvantageConfig":
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


__all__ = ["AdvantageConfig", "group_advantages", "grpo_advantages", "load_function", "reward_statistics"]
