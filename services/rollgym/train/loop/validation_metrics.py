"""Validation metrics by the name a plan gives them (`guard.accept`): which names can exist, and where each
sits in a validation summary.

    mean_reward, pass@K                      the validation's own figures
    reward_components.NAME                   a reward component's mean over the validation rollouts
    environments.ENV.METRIC                  one environment's figures, with a validation suite
"""

from __future__ import annotations

import re

_METRICS = "mean_reward, pass@K, reward_components.NAME, or environments.ENV.METRIC with a validation suite"


def metric_path(name: str) -> tuple[str | None, str]:
    """A guard metric's (environment, metric within it): "environments.weather.pass@4" -> ("weather", "pass@4");
    "mean_reward" -> (None, "mean_reward")."""
    if name.startswith("environments."):
        env, _, rest = name.removeprefix("environments.").partition(".")
        return env, rest
    return None, name


def metric_problem(name: str) -> str | None:
    """Why `name` can never be a metric of a validation summary (None: it can be one)."""
    env, metric = metric_path(name)
    if env == "" or (env is not None and not metric):
        return f"accept: metric {name!r}: write environments.ENV.METRIC (e.g. environments.weather.mean_reward)"
    if (metric == "mean_reward" or re.fullmatch(r"pass@[1-9]\d*", metric)
            or (metric.startswith("reward_components.") and metric != "reward_components.")):
        return None
    return f"accept: unknown metric {name!r}: use {_METRICS}"


def pass_k_problem(name: str, metric: str, repeats: int) -> str | None:
    """pass@K exists in a summary only for K = 1, 2, 4, ... up to the repeats, and the repeats themselves."""
    match = re.fullmatch(r"pass@(\d+)", metric)
    if match is None:
        return None
    from ...rollouts.metrics import k_values

    ks = k_values(repeats)
    if int(match.group(1)) in ks:
        return None
    return (f"{name!r} is never measured: validation with {repeats} repeats measures "
            f"{', '.join(f'pass@{k}' for k in ks)}")


__all__ = ["metric_path", "metric_problem", "pass_k_problem"]
