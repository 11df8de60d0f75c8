"""What a collection samples under, beyond one temperature: a temperature schedule over steps, and the
sampling knobs that reshape the distribution a trainer would have to rebuild.

- **Schedule.** `params.temperature` is a number, or Surogate's `temp_scheduler` as a mapping:
  `{type: linear | cosine, start_temperature, end_temperature}`, the start at the first step and the end at
  the last (a stage's epochs in epochs mode, `max_steps` in async mode). Every request carries the
  temperature of its step, and every generated item records it (`sampling.temperature`), so an RL trainer
  takes each rollout's own.
- **Knobs.** `min_tokens` (the end of turn is barred until that many tokens) and the penalties
  (`repetition_penalty`, `presence_penalty`, `frequency_penalty`) and `min_p` change which tokens can be drawn
  and with what probability: μ is then no longer softmax(logits / T), which is all the policy-gradient
  trainer computes. They go to the model server, are recorded where set, and `refuse_unreproducible` stops
  the trainer on a rollout sampled under one.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

# The knobs and their neutral values (the value that leaves the distribution as it is).
UNREPRODUCIBLE: dict[str, float] = {"min_tokens": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                                    "presence_penalty": 0.0, "frequency_penalty": 0.0}


def reshaping_knobs(sampling: Mapping[str, Any]) -> dict[str, Any]:
    """The knobs of a sampling record (or of request params) set away from their neutral value."""
    out = {}
    for key, neutral in UNREPRODUCIBLE.items():
        value = sampling.get(key)
        if value is not None and not isinstance(value, bool) and isinstance(value, (int, float)) \
                and float(value) != neutral:
            out[key] = value
    return out


def refuse_unreproducible(sampling: Mapping[str, Any], where: str, error: type[Exception] = ValueError) -> None:
    """Raise `error` naming the knobs a rollout's tokens were sampled under that a trainer cannot rebuild."""
    knobs = reshaping_knobs(sampling)
    if knobs:
        raise error(f"{where}: sampled with {', '.join(f'{k} {v}' for k, v in knobs.items())}: the trainer computes "
                    "softmax(logits / temperature) and cannot rebuild a distribution that min_tokens, min_p or a "
                    "penalty reshaped; collect without them (they suit SFT or filtering data, not RL)")


class TemperatureSchedule(BaseModel):
    """Surogate's `temp_scheduler`: the temperature moves from start (first step) to end (last step)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["linear", "cosine"]
    start_temperature: float = Field(ge=0.0)
    end_temperature: float = Field(ge=0.0)

    def at(self, step: int, last: int) -> float:
        """The temperature of `step` (0 = the first) of a run whose last step is `last`."""
        done = min(1.0, max(0.0, step / last)) if last > 0 else 0.0
        if self.type == "cosine":
            done = (1.0 - math.cos(math.pi * done)) / 2.0
        return round(self.start_temperature + (self.end_temperature - self.start_temperature) * done, 6)


def temperature_schedule(params: Mapping[str, Any]) -> TemperatureSchedule | None:
    """The schedule `params.temperature` gives, or None for a number (or none); ValueError names what is wrong."""
    value = params.get("temperature")
    if not isinstance(value, Mapping):
        return None
    try:
        return TemperatureSchedule.model_validate(value)
    except ValidationError as exc:
        raise ValueError("; ".join(f"temperature.{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
                                   for error in exc.errors())) from None


def params_at(params: Mapping[str, Any], step: int, last: int) -> dict[str, Any]:
    """`params` with a scheduled temperature replaced by its value at `step` of `last` (others unchanged)."""
    schedule = temperature_schedule(params)
    if schedule is None:
        return dict(params)
    return {**params, "temperature": schedule.at(step, last)}


__all__ = ["TemperatureSchedule", "UNREPRODUCIBLE", "params_at", "refuse_unreproducible", "reshaping_knobs",
           "temperature_schedule"]
