"""The streaming orchestrator: rollouts keep coming while the trainer steps, in bounded-stale batches.

    orchestrator = Orchestrator(config, registry, "runs/async")
    async for batch in orchestrator.batches():            # in-process trainer
        adapter = train_on(batch)                          # batch.rollouts carry `advantage`
        await orchestrator.finish_step(batch.step, adapter)  # hot-loads it on every model server
    await orchestrator.run_step_folders()                  # or: a trainer elsewhere reads ROOT/steps/

**Steps and versions.** The trainer's step `n` (from 1) trains on batch `n` and produces policy
version `n`; version 0 is the base model. A finished step's adapter is hot-loaded on every model server
(`POST /v1/load_lora_adapter`) before the version counts as current, and every model_version the
servers answer with is mapped back to the step it came from.

**Bounded staleness.** A group is dispatched for the step it will most likely land in (its `tag`),
and only when `tag - 1 - version <= max_async_level`: inference is never more than `max_async_level`
steps ahead of the trainer (0: fully synchronous). A rollout's `sampled_step` is the oldest version
among the model_versions of its generated items (the dispatch-time version when the servers report
none); its lag in batch `n` is `n - 1 - sampled_step`. A group whose lag exceeds
`max_off_policy_steps` is discarded whole and counted as `stale`.

**Full batches.** A batch is `batch_size` rollouts in whole groups of `rollouts_per_example`, mixed
across environments by ratio (`mixing.py`). A group that failed (a rollout still failing after its
retries), is stale, or is too easy or too hard for the difficulty filter is dropped and replaced by a
fresh one; `oversampling_factor` keeps that many times the missing groups in flight so the batch
fills without waiting for refills. A task found too easy or too hard goes to its source's pool, from
which it returns at `easy_fraction` / `hard_fraction` per pass (`mixing.py`). When a step has dropped
`max_drops_per_step` groups it is published with the groups it has (`groups_short` in its metrics)
rather than stopping the run, unless they are failures: those stop it with their causes. Failures
are written to `failures.jsonl`, never used as rewards.

**Metrics.** Each step's metrics go to `history.jsonl`: rollouts/s, reward mean and spread, dropped
groups by reason, the staleness histogram of the rollouts used, the time the trainer waited for the
batch, the time inference waited for the trainer, and how busy the rollout slots were.

Beside this module: `policy_versions` (hot-loading, model_version → step), `steps` (the step folders),
`resume` (where a killed run continues), `step_metrics` (the history lines), `step_server` (HTTP).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Literal, Mapping

import orjson

from ..client import ServerAddress, ServerClient
from ..rollouts.attempts import FailedAttempt, RetryPolicy, agent_for, build_payload, run_rollout
from .advantages import completion_length, group_advantages
from .mixing import POOLS, EnvMixer, SourceExhausted, SourceTask, load_sources
from .orchestrator_config import EnvSection, OrchestratorConfig
from .policy_versions import AdapterLoadError, PolicyVersions, model_versions
from .resume import ResumeError, repair_history, resume_point
from .step_metrics import Occupancy, SlotClient, step_metrics
from .steps import MARKER, Batch, StepFolders


class OrchestratorError(RuntimeError):
    """The orchestrator cannot go on (a batch cannot be filled, a hot-load failed); the message says why."""


class StepSignalError(ValueError):
    """A trainer's "step N is done" that cannot be taken: `reason` says why (`unknown_step`,
    `not_published`, `out_of_order`, `conflict`), `field` which part of the signal is wrong."""

    def __init__(self, message: str, reason: str, field: str = "step") -> None:
        super().__init__(message)
        self.reason, self.field = reason, field


DropReason = Literal["failed", "stale", "easy", "hard"]


@dataclass
class Group:
    """One task's `rollouts_per_example` rollouts as they came back."""

    env: str
    task: SourceTask
    group_id: str
    tag: int  # the step it was dispatched for
    dispatch_version: int
    rollouts: list[dict[str, Any]] = field(default_factory=list)
    failures: list[dict[str, Any]] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # per rollout: the policy version that sampled it
    verdict: DropReason | None = None  # the difficulty filter's

    def rewards(self) -> list[float]:
        return [float(r["reward"]) for r in self.rollouts]


@dataclass
class _VersionChanged:
    version: int


class Orchestrator:
    """Forms training batches from a stack's agents and keeps inference within the staleness bounds.

    `registry` names the stack's servers (agents to run tasks, model servers to hot-load); `output`
    is the run's folder (history.jsonl, failures.jsonl, and steps/ for the step-folder transport).
    """

    def __init__(self, config: OrchestratorConfig, registry: Mapping[str, ServerAddress], output: str | Path, *,
                 log: Callable[[str], None] = print) -> None:
        self.config = config
        self.registry = dict(registry)
        self.output = Path(output)
        self.log = log
        self.folders = StepFolders(self.output / "steps")
        envs = [(env.name, Path(env.input), env.limit) for env in config.envs]
        difficulty = config.difficulty
        promote = {"easy": difficulty.easy_fraction, "hard": difficulty.hard_fraction}
        self.sources, report = load_sources(envs, config.hash_keys, config.seed, config.shuffle, promote)
        for line in report["skipped"]:
            log(f"skipped: {line}")
        self.duplicates: dict[str, int] = report["duplicates"]
        self.mixer = EnvMixer({env.name: env.ratio for env in config.envs}, config.groups_per_step)
        self.envs = {env.name: env for env in config.envs}
        self.agents = {env.name: self._agent(env) for env in config.envs}
        self.versions = PolicyVersions(self.registry, config.model_servers, config.adapter_name, log)
        self.policy = RetryPolicy(max_attempts=config.max_attempts, timeout_s=config.timeout_s,
                                  budget_s=config.budget_s)
        self.version = 0
        self.next_step = 1
        self.done_at: dict[int, float] = {}  # version -> when it became current
        self.dispatch_log: deque[tuple[int, int]] = deque(maxlen=100_000)  # (tag, version) per dispatch, for tests
        self._dispatched = 0
        self._events: asyncio.Queue[Group | _VersionChanged] | None = None
        self._in_flight: dict[str, int] = {name: 0 for name in self.envs}
        self._tasks: set[asyncio.Task[None]] = set()
        self._spare: list[Group] = []
        self._unused: dict[str, Group] = {}  # dispatched, not yet in a batch nor dropped (a resume sends them again)
        self._client: ServerClient | None = None
        self._slot_client: SlotClient | None = None
        self._busy = Occupancy()
        self._failures_file: Any = None
        self._pending_adapter: str | None = None  # to load again before a resumed run generates
        self._record_finish = False  # finish_step writes step_N/ADAPTER (batches(persist=True))
        self.failure: str | None = None  # why the step-folder run stopped, for whoever waits on a step
        self._signalled = asyncio.Event()  # a trainer's signal came: the watcher looks at once
        self._progress = asyncio.Event()  # replaced each time a step finishes or the run fails
        self._check_agents()

    # ------------------------------------------------------------------ setup

    def _agent(self, env: EnvSection) -> str | None:
        """The agent an environment's tasks go to when the row names none (None: rows must name one)."""
        if env.agent is not None:
            if env.agent not in self.registry:
                raise ValueError(f"environment {env.name!r}: agent {env.agent!r} is not in the stack "
                                 f"(servers: {', '.join(sorted(self.registry)) or 'none'})")
            return env.agent
        agents = [name for name, address in self.registry.items() if address.role in ("agents", "")]
        return agents[0] if len(agents) == 1 else None

    def _check_agents(self) -> None:
        """Every task must reach an agent of the stack: say which environment and row cannot, before starting."""
        used: set[str] = set()
        for name, source in self.sources.items():
            for task in source.tasks:
                agent = agent_for(task.row, self.agents[name] or "")
                used.add(agent)
                if agent not in self.registry:
                    agents = sorted(n for n, a in self.registry.items() if a.role in ("agents", ""))
                    raise ValueError(f"environment {name!r}, task {task.group_id}: "
                                     + (f"agent {agent!r} is not in the stack" if agent else "no agent to run it")
                                     + f" (agents: {', '.join(agents) or 'none'}); set the environment's agent")
        self.versions.agents = sorted(used)

    @property
    def model_servers(self) -> list[str]:
        return self.versions.servers

    @property
    def version_steps(self) -> dict[str, int]:
        """model_version -> the step whose adapter it is (0: the base)."""
        return self.versions.steps

    # ------------------------------------------------------------------ the trainer's calls

    async def finish_step(self, step: int, adapter_path: str | Path | None) -> None:
        """The trainer finished `step`: apply its adapter (None: no new weights) and let later steps generate.

        Steps finish in order; finishing a step already finished is a no-op.
        """
        if step <= self.version:
            return
        if step != self.version + 1:
            raise ValueError(f"step {step} cannot finish before step {self.version + 1}")
        if step >= self.next_step:
            raise ValueError(f"step {step} has not been handed to the trainer yet")
        if adapter_path:
            await self.hot_load(str(adapter_path), step)
        if self._record_finish:  # in-process batches kept on disk: a resumed run knows what was applied
            await asyncio.to_thread(self.folders.finish, step, adapter_path or None)
        self.version = step
        self.done_at[step] = time.monotonic()
        if self._events is not None:
            self._events.put_nowait(_VersionChanged(step))
        self._wake()

    async def signal_finished(self, step: int, adapter_path: str | None) -> bool:
        """The trainer says it finished `step` with `adapter_path` (None or '': no new weights): the same
        as writing `steps/step_N/ADAPTER`, which the step-folder run applies in order. False when the
        step was signalled before with the same path (a retry); StepSignalError when it cannot be taken.
        """
        recorded = await asyncio.to_thread(self._check_signal, step, adapter_path or "")
        if recorded:
            return False
        await asyncio.to_thread(self.folders.finish, step, adapter_path or None)
        self._signalled.set()
        return True

    def _check_signal(self, step: int, path: str) -> bool:
        """Whether `step` was signalled before with `path`; StepSignalError if the signal cannot be taken."""
        last = self.config.max_steps
        if step < 1 or (last is not None and step > last):
            raise StepSignalError(f"step {step} does not exist: this run has steps 1..{last or 'N'}", "unknown_step")
        if step >= self.next_step and not (self.folders.path(step) / MARKER).exists():
            published = f"1..{self.next_step - 1}" if self.next_step > 1 else "none yet"
            raise StepSignalError(f"step {step} has not been handed out yet (published: {published})",
                                  "not_published")
        recorded = self.folders.finished(step)
        if recorded is not None:
            if recorded == path:
                return True
            raise StepSignalError(f"step {step} was finished already with adapter_path {recorded!r}, not {path!r}",
                                  "conflict", "adapter_path")
        if step - 1 > self.version and self.folders.finished(step - 1) is None:
            raise StepSignalError(f"step {step} cannot finish before step {step - 1}", "out_of_order")
        return False

    async def until_finished(self, step: int) -> None:
        """Wait until `step` is finished (its adapter served); OrchestratorError if the run stopped first."""
        while self.version < step:
            if self.failure is not None:
                raise OrchestratorError(self.failure)
            await self._progress.wait()

    def _wake(self) -> None:
        self._progress.set()
        self._progress = asyncio.Event()

    def status(self) -> dict[str, Any]:
        """Where the run stands: the step being formed, the steps ready for the trainer, what is applied."""
        newest, versions = self.versions.newest()
        return {"step": self.next_step, "max_steps": self.config.max_steps,
                "published": self.next_step - 1, "ready": list(range(self.version + 1, self.next_step)),
                "finished": self.version, "applied": {"step": newest, "adapter_path": self.versions.adapter,
                                                      "model_versions": versions},
                "max_async_level": self.config.max_async_level, "failure": self.failure}

    async def hot_load(self, adapter_path: str, step: int) -> None:
        """Load the adapter on every replica of every model server; OrchestratorError if one refuses."""
        async with _open_client(self):
            assert self._client is not None
            try:
                await self.versions.load(self._client, adapter_path, step)
            except AdapterLoadError as exc:
                raise OrchestratorError(str(exc)) from None

    # ------------------------------------------------------------------ transports

    async def batches(self, *, persist: bool = False, finished: int | None = None) -> AsyncIterator[Batch]:
        """Batches in step order for a trainer in this process; call `finish_step` after each.

        With `persist`, each batch is also published as a step folder (`output/steps/step_N/`) and each
        finished step's adapter path is recorded next to it, so a killed run started again on the same
        output resumes: batches handed out but not finished come again (the same rollouts), the last
        finished step's adapter is loaded again, and new batches continue from the last published one.
        `finished` says how many steps the caller has finished by its own record (default: the recorded
        adapters); a step finished but not recorded by the caller is handed out again.
        """
        queue: asyncio.Queue[Batch | None] = asyncio.Queue()

        async def publish(batch: Batch) -> None:
            if persist:
                await asyncio.to_thread(self.folders.write, batch)
            queue.put_nowait(batch)

        async def produce() -> None:
            try:
                await self.run(publish)
            finally:
                queue.put_nowait(None)

        replay: list[Batch] = []
        if persist:
            self._resume(finished)
            self._record_finish = True
            replay = [self.folders.read(step) for step in range(self.version + 1, self.next_step)]
        async with _open_client(self):
            # Before a replayed step's adapter is loaded, so that the older one cannot land over it.
            await self._reload_pending()
            producer = asyncio.create_task(produce())
            try:
                for batch in replay:
                    yield batch
                while (batch := await queue.get()) is not None:
                    yield batch
                await producer  # re-raises what stopped it
            finally:
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)

    async def run_step_folders(self, poll_s: float = 0.1, wait_for_trainer: bool = True) -> None:
        """Publish every batch as `output/steps/step_N/` and apply the adapters the trainer writes back.

        Resumes a killed run: published steps are kept, half-written ones removed, the last finished
        step's adapter is loaded again, and tasks continue where the last published step left them.
        With `wait_for_trainer`, returns once the trainer has finished the last step too.
        """
        self._resume()

        async def publish(batch: Batch) -> None:
            await asyncio.to_thread(self.folders.write, batch)

        async def watch() -> None:
            while True:
                self._signalled.clear()
                step = self.version + 1
                if step < self.next_step:
                    adapter = await asyncio.to_thread(self.folders.finished, step)
                    if adapter is not None:
                        await self.finish_step(step, adapter or None)
                        continue
                try:  # a signal over HTTP is seen at once, a file written by the trainer within poll_s
                    await asyncio.wait_for(self._signalled.wait(), poll_s)
                except TimeoutError:
                    pass

        try:
            async with _open_client(self):
                watcher = asyncio.create_task(watch())
                try:
                    await self.run(publish)
                    last = self.next_step - 1
                    while wait_for_trainer and self.version < last:
                        if watcher.done():
                            watcher.result()
                        await asyncio.sleep(poll_s)
                finally:
                    watcher.cancel()
                    await asyncio.gather(watcher, return_exceptions=True)
                if watcher.done() and not watcher.cancelled() and watcher.exception():
                    raise watcher.exception()  # type: ignore[misc]
        except Exception as exc:
            self.failure = str(exc) or type(exc).__name__
            self._wake()
            raise

    def _resume(self, finished: int | None = None) -> None:
        """Continue from the step folders of a previous run of this output folder (if any); `finished`
        overrides how many steps count as finished (else: those with the trainer's ADAPTER)."""
        try:
            point = resume_point(self.folders, finished, self.log)
        except ResumeError as exc:
            raise OrchestratorError(str(exc)) from None
        if not point.published:
            return
        for name, source_state in point.state.get("sources", {}).items():
            if name in self.sources:
                self.sources[name].restore(source_state)
        self._dispatched = int(point.state.get("dispatched", 0))
        self.next_step = point.last + 1
        self._pending_adapter = point.adapter
        self.version = point.finished
        repair_history(self.output / "history.jsonl", self.folders, point.published)
        self.log(f"resuming: steps 1..{point.last} published, 1..{point.finished} finished by the trainer")

    async def _reload_pending(self) -> None:
        """A resumed run serves the last finished step's adapter again before anything generates."""
        if self._pending_adapter:
            adapter, self._pending_adapter = self._pending_adapter, None
            await self.hot_load(adapter, self.version)

    # ------------------------------------------------------------------ the loop

    async def run(self, publish: Callable[[Batch], Awaitable[None]]) -> None:
        """Form and publish batches until `max_steps` (forever without it)."""
        async with _open_client(self):
            self.output.mkdir(parents=True, exist_ok=True)
            self._events = asyncio.Queue()
            assert self._client is not None
            self._slot_client = SlotClient(self._client, asyncio.Semaphore(self.config.concurrency), self._busy)
            self.done_at.setdefault(self.version, time.monotonic())
            await self.versions.learn_base(self._client)
            await self._reload_pending()
            self._busy.start(self.config.concurrency)
            last_ready = time.monotonic()
            with (self.output / "failures.jsonl").open("ab") as self._failures_file:
                try:
                    while self.config.max_steps is None or self.next_step <= self.config.max_steps:
                        batch = await self._form(self.next_step, last_ready)
                        await publish(batch)
                        last_ready = time.monotonic()
                        with (self.output / "history.jsonl").open("ab") as history:
                            history.write(orjson.dumps(batch.metrics) + b"\n")
                        self.next_step += 1
                finally:
                    for task in self._tasks:
                        task.cancel()
                    await asyncio.gather(*self._tasks, return_exceptions=True)
                    self._tasks.clear()
                    self._in_flight = {name: 0 for name in self.envs}
                    self._spare.clear()
                    self._unused.clear()

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
            if isinstance(event, _VersionChanged):
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
        rollouts = self._annotate(step, groups)
        metrics = step_metrics(step, rollouts, [group.env for group in groups], policy_version=self.version,
                               dropped=dropped, failure_statuses=failure_statuses, generated=generated,
                               inference_wait=inference_wait, previous_ready=previous_ready, ready=ready,
                               trainer_done=self.done_at.get(step - 1), slots_busy=self._busy.take())
        metrics["groups_short"] = config.groups_per_step - len(groups)
        pending = {name: [group.task for group in self._unused.values() if group.env == name] for name in self.sources}
        state = {"sources": {name: source.state(pending[name]) for name, source in self.sources.items()},
                 "dispatched": self._dispatched}
        return Batch(step, rollouts, metrics, state)

    def _place(self, group: Group, step: int, quotas: dict[str, int], accepted: dict[str, list[Group]],
               dropped: Counter[str]) -> None:
        """Accept a finished group into batch `step`, keep it for the next one, or drop it (counted)."""
        reason = self._judge(group, step)
        if reason is not None:
            dropped[reason] += 1
            self._unused.pop(group.group_id, None)
            if reason in POOLS:
                self.sources[group.env].retire(group.task, reason)
        elif len(accepted[group.env]) < quotas.get(group.env, 0):
            accepted[group.env].append(group)
        else:
            self._spare.append(group)  # its environment's share of this step is full: the next step's

    def _judge(self, group: Group, step: int) -> DropReason | None:
        if group.failures or len(group.rollouts) < self.config.rollouts_per_example:
            return "failed"
        if step - 1 - min(group.sampled) > self.config.max_off_policy_steps:
            return "stale"
        return group.verdict

    def _difficulty(self, group: Group) -> DropReason | None:
        """'easy' or 'hard' for a group the difficulty filter drops (decided once, when it comes back)."""
        difficulty = self.config.difficulty
        if not difficulty.enabled or group.failures:
            return None
        rewards = group.rewards()
        mean = sum(rewards) / len(rewards)
        if min(rewards) >= difficulty.reward_max or (
                difficulty.easy_threshold is not None and mean >= difficulty.easy_threshold):
            return "easy"
        if max(rewards) <= difficulty.reward_min or (
                difficulty.hard_threshold is not None and mean <= difficulty.hard_threshold):
            return "hard"
        return None

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
            self._rollout(agent, build_payload(group.task.row, env.params, group.group_id, f"{group.group_id}-r{k}"),
                          group) for k in range(self.config.rollouts_per_example)))
        for rollout, failure in outcomes:
            if rollout is not None:
                group.rollouts.append(rollout)
                group.sampled.append(self.versions.sampled_step(rollout, group.dispatch_version))
            elif failure is not None:
                group.failures.append(failure.to_json())
        group.verdict = self._difficulty(group)
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

    # ------------------------------------------------------------------ batches

    def _annotate(self, step: int, groups: list[Group]) -> list[dict[str, Any]]:
        rollouts = []
        for group in groups:
            lengths = [completion_length(r) for r in group.rollouts]
            advantages = group_advantages(group.rewards(), lengths, self.config.advantage)
            for rollout, advantage, sampled in zip(group.rollouts, advantages, group.sampled):
                rollout.update(advantage=advantage, step=step, env=group.env, generated_for_step=group.tag,
                               sampled_step=sampled, policy_lag=step - 1 - sampled)
                rollouts.append(rollout)
        return rollouts


class _open_client:
    """The orchestrator's HTTP client and locks for the duration of a run (nested uses share one)."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        self.owner = False

    async def __aenter__(self) -> None:
        orchestrator = self.orchestrator
        if orchestrator._client is None:
            self.owner = True
            orchestrator._client = ServerClient(orchestrator.registry, timeout_s=orchestrator.config.timeout_s,
                                                max_retries=2)

    async def __aexit__(self, *exc: Any) -> None:
        if self.owner and self.orchestrator._client is not None:
            await self.orchestrator._client.close()
            self.orchestrator._client = None


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in counter.most_common()) or "none"


__all__ = ["Batch", "Orchestrator", "OrchestratorError", "StepSignalError", "model_versions"]
