"""The validate phase: the served model on held-out tasks (`validation.input`) or an eval suite's
environments (`validation.suite`), every N epochs (async: steps) and at epoch 0 for the base model.

Every validation rollout must come from the model being validated: one sampled by other weights fails
the phase. A suite's summary is the mean over its environments (mean_reward, and each pass@k they all
have) beside every environment's own. A summary also holds each reward component's mean
(`reward_components`), when the environment reports components.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...data.jsonl import read_whole_lines
from ...rollouts.collector import CollectOptions
from .collect import Collections
from .curation import on_policy
from .errors import TrainError
from .plan import validation_environments
from .policies import off_policy, policy_summary


class Validation:
    """The plan's validation section, run through the loop's collections."""

    def __init__(self, collections: Collections) -> None:
        self.collections = collections
        self.plan = collections.plan

    def due(self, number: int) -> bool:
        """Whether epoch (step) `number` is validated."""
        return self.plan.validation is not None and number % self.plan.validation.every == 0

    def validate(self, number: int, folder: Path) -> dict[str, Any]:
        """Validate the served model; the summary for the history line."""
        section = self.plan.validation
        assert section is not None
        if section.suite is not None:
            return self._suite(number, folder)
        options = self.collections.options(Path(section.input or ""), folder / "validation.jsonl",
                                           repeats=section.repeats, limit=section.limit, params=section.params,
                                           pass_threshold=section.pass_threshold)
        return self._collection(number, options)

    def _suite(self, number: int, folder: Path) -> dict[str, Any]:
        each = {}
        for env in validation_environments(self.plan):
            options = self.collections.options(env.tasks, folder / f"validation-{env.name}.jsonl", repeats=env.repeats,
                                               limit=env.limit, params=env.params, pass_threshold=env.pass_threshold)
            each[env.name] = self._collection(number, options, env.agent)
        summary: dict[str, Any] = {"suite": self.plan.validation.suite if self.plan.validation else None}
        shared = set.intersection(*(set(k for k, v in s.items() if isinstance(v, (int, float))) for s in each.values()))
        for key in sorted(k for k in shared if k == "mean_reward" or k.startswith("pass@")):
            values = [s[key] for s in each.values() if s.get(key) is not None]
            summary[key] = sum(values) / len(values) if values else None
        summary["environments"] = each
        return summary

    def _collection(self, number: int, options: CollectOptions, agent: str | None = None) -> dict[str, Any]:
        summary = self.collections.run(options, f"epoch {number} validate", agent)
        version = self.collections.serving.version
        rollouts = read_whole_lines(options.output)
        if self.plan.policies:  # each call's weights must be its own policy's served ones
            versions = self.collections.serving.policy_versions
            if stale := off_policy(rollouts, versions):
                raise TrainError(f"epoch {number} validate: {stale} rollouts hold calls from other model versions "
                                 f"than their policies' ({versions})")
            summary["policies"] = policy_summary(rollouts, self.plan.policies, self.plan.credit)
        else:
            stale = sum(1 for r in rollouts if version is not None and not on_policy(r, version))
            if stale:
                raise TrainError(f"epoch {number} validate: {stale} rollouts came from another "
                                      f"model version than {version}")
        components = component_means(rollouts)
        if components:
            summary["reward_components"] = components
        return summary


def component_means(rollouts: list[dict[str, Any]]) -> dict[str, float]:
    """Each reward component's mean over the rollouts that report it (the guard's `reward_components.NAME`)."""
    values: dict[str, list[float]] = {}
    for rollout in rollouts:
        for name, value in (rollout.get("reward_components") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                values.setdefault(name, []).append(float(value))
    return {name: sum(each) / len(each) for name, each in sorted(values.items())}


__all__ = ["Validation", "component_means"]
