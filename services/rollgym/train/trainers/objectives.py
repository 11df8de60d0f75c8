"""Objectives of the GRPO trainer as plug-ins: an objective is a small class with its own settings model,
`LossInputs -> LossOutputs` over a micro-batch's loss tokens, and its own named statistics, found by name.

    loss: {objective: ppo_tis, clip_high: 0.28}        # a built-in, by name (OBJECTIVES)
    loss: {objective: mypkg.loss:MyObjective, beta: 2}  # one's own, by import path

The plan's `optimize.args.loss` holds the keys every objective shares (`objective`, `aggregation`,
`max_tokens`: the trainer applies the aggregation's scales) beside the objective's own keys, which its
`Config` model validates when the plan is loaded (`rollgym train --check` imports it). The trainer adds the
objective's `statistics` up over micro-batches and processes (a name ending in `_min` or `_max` is reduced by
min or max) and writes what `metrics` makes of them into the step's history. docs/your-own-objective.md
walks through one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ...config import import_target

Aggregation = Literal["token_mean", "sequence_mean", "constant"]
# The built-in objectives, by name: import paths, so that this registry imports none of them.
OBJECTIVES: dict[str, str] = {
    "ppo_tis": "rollgym.train.trainers.grpo_loss:PPOTIS",
    "surogate": "rollgym.train.trainers.grpo_loss:Surogate",
}


@dataclass
class LossInputs:
    """A micro-batch's loss tokens as flat 1-D tensors of one length (only tokens the policy sampled).

    `logprobs` log π_θ (the gradient flows through it); `old_logprobs` π_old (no gradient); `sampling_logprobs`
    log μ, what the model server recorded; `advantages` and `scales` per token (the rollout's A_i, or its
    turn's, and the aggregation's s_i); `rollout_index` numbers the sequence (0 .. rollouts-1) each token
    belongs to; `ref_logprobs` the reference model's (only when the objective's kl_beta > 0);
    `teacher_logprobs` a teacher's, NaN where a token has no teacher term (sampled under a grammar)."""

    logprobs: Any
    old_logprobs: Any
    sampling_logprobs: Any
    advantages: Any
    rollout_index: Any
    scales: Any
    rollouts: int
    ref_logprobs: Any = None
    teacher_logprobs: Any = None


@dataclass
class LossOutputs:
    """What an objective returns: `loss`, a scalar already scaled (the sum over micro-batches is the batch's
    loss); `tokens`, the loss tokens it saw; `stats`, a float64 tensor on the batch's device, one value per
    name of the objective's `statistics` (read once per step: reading it waits for the GPU)."""

    loss: Any
    tokens: int
    stats: Any
    names: tuple[str, ...] = ()

    def stat(self, name: str) -> float:
        """One value of `stats`, by its name."""
        return float(self.stats[self.names.index(name)])


class NoSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Objective:
    """Base of an objective. A subclass sets `name`, `Config` (a pydantic model of its keys; extra keys are
    refused) and `statistics`, and implements `__call__`; `metrics` turns the step's summed statistics into
    history entries (by default each sum per loss token, and `_min`/`_max` ones as they are)."""

    name: ClassVar[str] = ""
    Config: ClassVar[type[BaseModel]] = NoSettings
    statistics: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: BaseModel) -> None:
        self.config = config

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        raise NotImplementedError

    def metrics(self, sums: dict[str, float], tokens: float) -> dict[str, float]:
        return {name: value if name.endswith(("_min", "_max")) else value / tokens for name, value in sums.items()}

    @property
    def kl_beta(self) -> float:
        """The weight of a KL term to the reference model: the trainer computes reference logprobs when > 0."""
        return float(getattr(self.config, "kl_beta", 0.0) or 0.0)

    @property
    def teacher_tau(self) -> float:
        """The weight of a teacher's term: > 0 needs a teacher's logprobs on every sequence."""
        return float(getattr(self.config, "teacher_tau", 0.0) or 0.0)

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.config == other.config  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]


def find_objective(name: str) -> type[Objective]:
    """The objective class a plan names: a built-in's name, or an import path `module:Class`. ValueError
    names what cannot be found or is not an objective."""
    path = OBJECTIVES.get(name, name)
    if ":" not in path:
        raise ValueError(f"unknown objective {name!r}: use one of {', '.join(OBJECTIVES)} or an import path "
                         "'module:Class'")
    found = import_target(path)
    if not (isinstance(found, type) and issubclass(found, Objective)):
        raise ValueError(f"{name!r} is not an objective: subclass rollgym.train.trainers.objectives.Objective")
    if not (isinstance(found.Config, type) and issubclass(found.Config, BaseModel)):
        raise ValueError(f"objective {name!r}: its Config must be a pydantic model")
    return found


class LossConfig(BaseModel):
    """The plan's `optimize.args.loss`: the keys every objective shares, and the objective's own (validated by
    its `Config`, read as attributes of this object). `objective` unset: `surogate` when any of its keys is
    given (a Surogate `loss:` block pastes in unchanged), else `ppo_tis`."""

    model_config = ConfigDict(extra="allow")

    objective: str | None = Field(default=None, description="ppo_tis (default), surogate, or 'module:Class'")
    aggregation: Aggregation = "token_mean"
    max_tokens: int | None = Field(default=None, ge=1, description="constant aggregation: the normaliser C")
    _impl: Objective | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _objective(self) -> "LossConfig":
        given = dict(self.__pydantic_extra__ or {})
        builtins = {name: find_objective(name) for name in OBJECTIVES}
        if self.objective is None:
            own = set(builtins["surogate"].Config.model_fields) - set(builtins["ppo_tis"].Config.model_fields)
            self.objective = "surogate" if own & set(given) else "ppo_tis"
        try:
            chosen = find_objective(self.objective)
        except ValueError as exc:
            raise ValueError(f"objective: {exc}") from None
        for key in list(given):
            if key in chosen.Config.model_fields:
                continue
            owner = next((each for each in builtins.values() if key in each.Config.model_fields), None)
            # A built-in's key at its default (a dumped config lists every key) says nothing: dropped.
            if owner is not None and given[key] == owner.Config.model_fields[key].default:
                del given[key]
            elif owner is not None:
                raise ValueError(f"{key} is a setting of objective: {owner.name}, but the objective is {self.objective}")
        settings = chosen.Config.model_validate(given)  # its errors keep their keys: args.loss.clip_high
        if self.aggregation == "constant" and self.max_tokens is None:
            raise ValueError("aggregation: constant needs max_tokens (the normaliser, e.g. the generation budget)")
        self.__pydantic_extra__ = settings.model_dump()  # every key of the objective, validated
        self._impl = chosen(settings)
        return self

    @property
    def impl(self) -> Objective:
        """The objective, built once from its validated settings."""
        assert self._impl is not None
        return self._impl

    @property
    def kl_beta(self) -> float:
        return self.impl.kl_beta

    @property
    def teacher_tau(self) -> float:
        return self.impl.teacher_tau

    def __getattr__(self, name: str) -> Any:
        # The objective's settings read as this object's attributes (loss.clip_high), typed as its Config made them.
        private = object.__getattribute__(self, "__pydantic_private__") or {}
        impl = private.get("_impl")
        if impl is not None and not name.startswith("_") and name in type(impl.config).model_fields:
            return getattr(impl.config, name)
        return super().__getattr__(name)  # type: ignore[misc]


__all__ = ["Aggregation", "LossConfig", "LossInputs", "LossOutputs", "OBJECTIVES", "Objective", "find_objective"]
