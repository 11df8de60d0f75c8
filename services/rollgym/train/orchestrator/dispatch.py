"""Starting groups: as many as the rollout slots and the staleness bound allow, each for the step it will
most likely land in.

A group is dispatched for a step (its `tag`) only while `tag - 1 - version <= max_async_level`:
inference is never more than `max_async_level` steps ahead of the trainer (0: fully synchronous).
`oversampling_factor` keeps that many times the missing groups in flight, so a batch fills without
waiting for refills. Each rollout runs under the collector's retry policy (`rollouts.attempts`), holding
a slot only while an attempt runs; a failure goes to `failures.jsonl`, never into a reward. A rollout's
sampling version is the oldest step among the model_versions of its generated items, spans of a generation
continued across weight updates included (`policy_versions.sampled_step`: its oldest token), the
dispatch-time version when the servers report none; how many tokens each step sampled is kept beside it.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter, deque
from typing import Any

import orjson

from ...data.sampling import params_at
from ...rollouts.attempts import FailedAttempt, RetryPolicy, agent_for, build_payload, run_rollout
from .config import EnvConfig, OrchestratorConfig
from .errors import OrchestratorError
from .groups import Group, VersionChanged, group_verdict
from .metrics import SlotClient
from .policy_versions import PolicyVersions
from .sources import EnvMixer, SourceExhausted, TaskSource


class Dispatching:
    """The orchestrator's dispatching side (a part of `Orchestrator`, which holds the state named here)."""

    config: OrchestratorConfig
    version: int
    mixer: EnvMixer
    sources: dict[str, TaskSource]
    envs: dict[str, EnvConfig]
    agents: dict[str, str | None]
    versions: PolicyVersions
    policy: RetryPolicy
    dispatch_log: deque[tuple[int, int]]
    _events: asyncio.Queue[Group | VersionChanged] | None
    _in_flight: dict[str, int]
    _spare: list[Group]
    _unused: dict[str, Group]
    _dispatched: int
    _tasks: set[asyncio.Task[None]]
    _slot_client: SlotClient | None
    _failures_file: Any

    def _dispatch(self, step: int, quotas: dict[str, int], accepted: dict[str, list[Group]]) -> bool:
        """Start as many groups as the bounds allow; True when the staleness gate held one back."""
        config = self.config
        # One group more than the slots hold: its rollouts take slots as the previous groups free them.
        max_groups = math.ceil(config.concurrency / config.rollouts_per_example) + 1
        last = self.version + 1 + config.max_async_level  # the furthest step inference may work for
        if config.max_steps is not None:
            last = min(last, config.max_steps)
        spare = Counter(group.env for group in self._spare)
        while sum(self._in_flight.values()) < max_groups:
            choice = None
            for name in quotas:
                if self.mixer.weights[name] == 0:
                    continue
                tag = self._tag(name, step, last, quotas[name] - len(accepted[name]),
                                self._in_flight[name] + spare[name])
                if tag is not None and (choice is None or tag < choice[0]):
                    choice = (tag, name)
            if choice is None:
                # Nothing is wanted up to `last`: held back by the trainer unless the run is complete.
                return last < (config.max_steps or last + 1) or last < step
            self._start(choice[1], choice[0])
        return False

    def _tag(self, env: str, step: int, last: int, missing: int, available: int) -> int | None:
        """The step a new group of `env` would serve (its groups in flight or kept serve the first ones),
        or None when none up to step `last` needs one."""
        factor = self.config.oversampling_factor
        wanted = 0
        for later in range(step, last + 1):
            wanted += math.ceil((max(0, missing) if later == step else self.mixer.quotas(later)[env]) * factor)
            if wanted > available:
                return later
        return None

    def _start(self, env: str, tag: int) -> None:
        try:
            task = self.sources[env].next()
        except SourceExhausted as exc:
            raise OrchestratorError(str(exc)) from None
        self._dispatched += 1
        group = Group(env, task, f"{task.group_id}-d{self._dispatched}", tag, self.version)
        self._unused[group.group_id] = group
        self._in_flight[env] += 1
        self.dispatch_log.append((tag, self.version))
        job = asyncio.create_task(self._run_group(group))
        self._tasks.add(job)
        job.add_done_callback(self._tasks.discard)

    async def _run_group(self, group: Group) -> None:
        assert self._events is not None
        env = self.envs[group.env]
        agent = agent_for(group.task.row, self.agents[group.env] or "")
        outcomes = await asyncio.gather(*(
            self._rollout(agent, build_payload(group.task.row, params_at(env.params, group.tag - 1,
                                                                         (self.config.max_steps or 1) - 1),
                                               group.group_id, f"{group.group_id}-r{k}"),
                          group) for k in range(self.config.rollouts_per_example)))
        for rollout, failure in outcomes:
            if rollout is not None:
                group.rollouts.append(rollout)
                group.sampled.append(self.versions.sampled_step(rollout, group.dispatch_version))
                group.token_steps.append(self.versions.sampled_tokens(rollout, group.dispatch_version))
            elif failure is not None:
                group.failures.append(failure.to_json())
        group.verdict = group_verdict(group, self.config.difficulty)
        self._events.put_nowait(group)

    async def _rollout(self, agent: str, payload: dict[str, Any], group: Group
                       ) -> tuple[dict[str, Any] | None, FailedAttempt | None]:
        """One rollout under the collector's retry policy, holding a slot only while an attempt runs."""
        assert self._slot_client is not None
        return await run_rollout(self._slot_client, agent, payload, self.policy,  # type: ignore[arg-type]
                                 where={"env": group.env}, on_failure=self._record_failure)

    def _record_failure(self, failed: FailedAttempt) -> None:
        self._failures_file.write(orjson.dumps(failed.to_json()) + b"\n")
        self._failures_file.flush()


__all__ = ["Dispatching"]
