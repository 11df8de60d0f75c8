"""What a collection samples under, beyond one temperature: a temperature schedule over steps.

- **Schedule.** `params.temperature` is a number, or Surogate's `temp_scheduler` as a mapping:
  `{type: linear | cosine, start_temperature, end_temperature}`, the start at the first step and the end at
  the last (a stage's epochs in epochs mode, `max_steps` in async mode). Every request carries the
  temperature of its step, and every generated item records it (`sampling.temperature`), so an RL trainer
  takes each rollout's own.
- **Knobs.** `min_tokens`, `min_p` and the penalties change which tokens can be drawn and with what
  probability; which of them a trainer can rebuild is the sampling contract's (`rollgym.sampling_contract`).
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError


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


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """A config's sampling `params` as they are (a field validator of `params`), or ValueError naming each
    mistake by its key, one per line: a schedule's, or a value out of its range (the sampling contract's RANGES),
    found when the config is read rather than by the first request."""
    from ..sampling_contract import range_problems

    temperature_schedule(params)
    if problems := range_problems(params):
        raise ValueError("\n".join(problems))
    return params


def params_at(params: Mapping[str, Any], step: int, last: int) -> dict[str, Any]:
    """`params` with a scheduled temperature replaced by its value at `step` of `last` (others unchanged)."""
    schedule = temperature_schedule(params)
    if schedule is None:
        return dict(params)
    return {**params, "temperature": schedule.at(step, last)}


__all__ = ["TemperatureSchedule", "check_params", "params_at", "temperature_schedule"]
