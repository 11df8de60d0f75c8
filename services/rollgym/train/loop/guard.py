"""The guard: a validated model that fell too far below the best, or misses an acceptance threshold,
does not stay served.

    guard: {max_drop: 0.1, accept: {pass@4: 0.8, reward_components.used_tool: 1.0}, on_violation: stop}

`accept` names any metric of the validation summary: `mean_reward`, `pass@K`, `reward_components.NAME`
(that component's mean over the validation rollouts) and, with a suite, `environments.ENV.METRIC` (one
environment's own figures).

Both modes judge alike (`guard_problems`); they differ in what they can do about it. An epochs run
serves the best model again and trains on from it (`on_violation: continue`) or stops; an async run
stops, leaving the best model as the one to use, because generation already runs ahead on the newest
weights and cannot roll back. A validation without a mean reward is not judged. The best model so far
lives in the run's state (`state["best"]`: reward, artefact, version), so a resumed run keeps it.
"""

from __future__ import annotations

from typing import Any, Callable

from ..trainers.base import Artefact
from .plan import GuardConfig
from .validation_metrics import metric_path


def metric_value(summary: dict[str, Any], name: str) -> float | None:
    """A metric of a validation summary by its guard name (`validation_metrics.metric_path`): `mean_reward`, `pass@4`,
    `reward_components.NAME` (the mean of that component), `environments.ENV.METRIC` (a suite's environment);
    None when the summary does not have it."""
    env, metric = metric_path(name)
    if env is not None:
        summary = (summary.get("environments") or {}).get(env) or {}
    if metric.startswith("reward_components."):
        summary = summary.get("reward_components") or {}
        metric = metric.removeprefix("reward_components.")
    value = summary.get(metric)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def guard_problems(summary: dict[str, Any], best: dict[str, Any] | None, max_drop: float | None,
                   accept: dict[str, float]) -> list[str]:
    """Why a validated model may not stay: its reward fell more than max_drop below the best, or a
    metric is below its acceptance threshold (a missing metric counts as below)."""
    problems = []
    reward = summary.get("mean_reward")
    if max_drop is not None and best is not None and reward is not None and reward + 1e-12 < best["reward"] - max_drop:
        problems.append(f"validation reward {reward:.3f} fell more than {max_drop} below the best {best['reward']:.3f}")
    for metric, least in accept.items():
        value = metric_value(summary, metric)
        if value is None or value + 1e-12 < least:
            shown = "missing" if value is None else f"{value:.3f}"
            problems.append(f"validation {metric} {shown} is below the accepted {least}")
    return problems


class Guard:
    """The plan's guard; it reads and changes the run's state (the dict the loop saves) it is given."""

    def __init__(self, config: GuardConfig | None, log: Callable[[str], None]) -> None:
        self.config = config
        self.log = log

    @staticmethod
    def remember_best(state: dict[str, Any], summary: dict[str, Any], artefact: Artefact | None,
                      version: str | None) -> None:
        reward = summary.get("mean_reward")
        best = state.get("best")
        if reward is not None and (best is None or reward > best["reward"]):
            state["best"] = {"reward": reward, "artefact": artefact.model_dump() if artefact else None,
                             "version": version}

    def check(self, state: dict[str, Any], summary: dict[str, Any], artefact: Artefact | None, version: str | None,
              restore: Callable[[Artefact | None], str | None] | None) -> dict[str, Any] | None:
        """Judge the model just validated (`artefact`, served as `version`): None without a guard, else
        the verdict for the history line. On a violation the best model becomes the applied one:
        `restore(best)` serves it again and returns its version (epochs mode); without `restore` (async
        mode) the run stops. The caller saves the state."""
        config = self.config
        problems = [] if config is None else guard_problems(summary, state.get("best"), config.max_drop, config.accept)
        if config is None or summary.get("mean_reward") is None or not problems:
            self.remember_best(state, summary, artefact, version)
            return None if config is None else {"ok": True}
        best = state.get("best")
        state["applied"] = best["artefact"] if best else None
        if restore is None:
            restored = (best or {}).get("version") or "the base model"
            state["stopped"] = f"{'; '.join(problems)}; the best model is {restored}"
            self.log(f"guard: {'; '.join(problems)}: stopping; the best model is {restored}")
            return {"ok": False, "problems": problems, "best": best["reward"] if best else None, "action": "stop"}
        restored = restore(Artefact.model_validate(best["artefact"]) if best and best["artefact"] else None)
        state["last"] = state["applied"]  # the next epoch trains on from the restored weights
        verdict = {"ok": False, "reward": summary.get("mean_reward"), "best": best["reward"] if best else None,
                   "restored": restored, "action": config.on_violation}
        if config.accept:
            verdict["problems"] = problems
        if config.on_violation == "stop":
            state["stopped"] = f"{'; '.join(problems)}; restored {restored}"
        self.log(f"guard: {'; '.join(problems)}: restored {restored}")
        return verdict


__all__ = ["Guard", "guard_problems", "metric_value"]
