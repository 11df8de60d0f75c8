"""Forming step `n`'s batch: whole groups as they come back, judged, placed, and annotated.

A batch is `batch_size` rollouts in whole groups of `rollouts_per_example`, mixed across environments by
ratio (`sources.EnvMixer`). Batch `n` is formed only once the trainer is within `max_async_level` of it;
groups that come back before that wait as spares. A group that cannot be used (`groups.drop_reason`) is
dropped, counted, and replaced by a fresh one (`dispatch.py`); a task found too easy or too hard goes to
its source's pool. When a step has dropped `max_drops_per_step` groups it is published with the groups it
has (`groups_short` in its metrics) rather than stopping the run, unless they are failures: those stop it
with their causes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from .config import OrchestratorConfig
from .errors import OrchestratorError
from .groups import Group, VersionChanged, annotate, drop_reason
from .metrics import Occupancy, filter_metrics, step_metrics
from .sources import POOLS, EnvMixer, TaskSource
from .transports.folders import Batch


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in counter.most_common()) or "none"


class BatchForming:
    """The orchestrator's batch-forming side (a part of `Orchestrator`, which holds the state named here)."""

    config: OrchestratorConfig
    output: Path
    log: Callable[[str], None]
    version: int
    mixer: EnvMixer
    sources: dict[str, TaskSource]
    done_at: dict[int, float]
    _events: asyncio.Queue[Group | VersionChanged] | None
    _in_flight: dict[str, int]
    _spare: list[Group]
    _unused: dict[str, Group]
    _dispatched: int
    _busy: Occupancy
    _dispatch: Callable[[int, dict[str, int], dict[str, list[Group]]], bool]  # dispatch.Dispatching

    async def _form(self, step: int, previous_ready: float) -> Batch:
        """Fill batch `step` with whole groups, dropping and replacing what cannot be used."""
        config = self.config
        assert self._events is not None
        quotas = self.mixer.quotas(step)
        accepted: dict[str, list[Group]] = {name: [] for name in quotas}
        dropped: Counter[str] = Counter()
        failure_statuses: Counter[str] = Counter()
        generated = 0
        inference_wait = 0.0
        limit = config.max_drops_per_step or 20 * config.groups_per_step
        short = False
        spares_placed = False
        while True:
            # Batch `step` is formed only once the trainer is within `max_async_level` of it.
            gate_open = step - 1 - self.version <= config.max_async_level
            if gate_open and not spares_placed:
                spare, self._spare, spares_placed = self._spare, [], True
                for group in spare:
                    self._place(group, step, quotas, accepted, dropped)
            if gate_open and all(len(accepted[name]) >= quotas[name] for name in quotas):
                break
            blocked = self._dispatch(step, quotas, accepted)
            started = time.monotonic()
            event = await self._events.get()
            if blocked:
                inference_wait += time.monotonic() - started
            if isinstance(event, VersionChanged):
                continue
            self._in_flight[event.env] -= 1
            generated += len(event.rollouts)
            for failure in event.failures:
                failure_statuses[failure["status"]] += 1
            if gate_open:
                self._place(event, step, quotas, accepted, dropped)
            else:
                self._spare.append(event)
            if dropped["failed"] >= limit:
                raise OrchestratorError(
                    f"step {step}: {dropped['failed']} groups failed while filling {config.groups_per_step}; see "
                    f"the failures and their causes in {self.output / 'failures.jsonl'}")
            # Too many groups taught nothing (easy, hard, stale): train on the groups there are rather
            # than stop; the pools keep those tasks from coming back on every pass.
            if gate_open and sum(dropped.values()) >= limit and any(accepted.values()):
                short = True
                break
        ready = time.monotonic()
        groups = [group for name in quotas for group in accepted[name]]
        for group in groups:
            self._unused.pop(group.group_id, None)
        if short:
            self.log(f"step {step}: {sum(dropped.values())} groups dropped ({_counts(dropped)}): a batch of "
                     f"{len(groups)} groups of {config.groups_per_step}")
        rollouts = annotate(step, groups, self.config)
        metrics = step_metrics(step, rollouts, [group.env for group in groups], policy_version=self.version,
                               dropped=dropped, failure_statuses=failure_statuses, generated=generated,
                               inference_wait=inference_wait, previous_ready=previous_ready, ready=ready,
                               trainer_done=self.done_at.get(step - 1), slots_busy=self._busy.take())
        metrics["groups_short"] = config.groups_per_step - len(groups)
        if config.filters:
            metrics.update(filter_metrics(rollouts))
        pending = {name: [group.task for group in self._unused.values() if group.env == name] for name in self.sources}
        state = {"sources": {name: source.state(pending[name]) for name, source in self.sources.items()},
                 "dispatched": self._dispatched}
        return Batch(step, rollouts, metrics, state)

    def _place(self, group: Group, step: int, quotas: dict[str, int], accepted: dict[str, list[Group]],
               dropped: Counter[str]) -> None:
        """Accept a finished group into batch `step`, keep it for the next one, or drop it (counted)."""
        reason = drop_reason(group, step, self.config)
        if reason is not None:
            dropped[reason] += 1
            self._unused.pop(group.group_id, None)
            if reason in POOLS:
                self.sources[group.env].retire(group.task, reason)
        elif len(accepted[group.env]) < quotas.get(group.env, 0):
            accepted[group.env].append(group)
        else:
            self._spare.append(group)  # its environment's share of this step is full: the next step's


__all__ = ["BatchForming"]
