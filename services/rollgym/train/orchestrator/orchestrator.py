"""The streaming orchestrator: rollouts keep coming while the trainer steps, in bounded-stale batches.

    orchestrator = Orchestrator(config, registry, "runs/async")
    async for batch in orchestrator.batches():            # in-process trainer
        adapter = train_on(batch)                          # batch.rollouts carry `advantage`
        await orchestrator.finish_step(batch.step, adapter)  # hot-loads it on every model server
    await orchestrator.run_step_folders()                  # or: a trainer elsewhere reads ROOT/steps/

**Steps and versions.** The trainer's step `n` (from 1) trains on batch `n` and produces policy
version `n`; version 0 is the base model. A finished step's adapter is hot-loaded on every model server
(`POST /v1/load_lora_adapter`) before the version counts as current, and every model_version the
servers answer with is mapped back to the step it came from (`policy_versions.py`).

**Bounded staleness.** Groups are dispatched for the step they will most likely land in, never more
than `max_async_level` steps ahead of the trainer (`dispatch.py`); a rollout's lag in batch `n` is
`n - 1 - sampled_step`, and a group whose lag exceeds `max_off_policy_steps` is discarded whole and
counted as `stale` (`groups.py`). Batches are filled with whole groups, dropped ones replaced
(`batches.py`); tasks come from `sources.py`.

**Metrics.** Each step's metrics go to `history.jsonl` (`metrics.py`): rollouts/s, reward mean and
spread, dropped groups by reason, the staleness histogram of the rollouts used, the time the trainer
waited for the batch, the time inference waited for the trainer, and how busy the rollout slots were.

This module holds the orchestrator's state, the trainer's calls (`finish_step`, a signal, `status`),
the run and its two ways of handing out batches (in-process `batches()`, or step folders with the step
server's signal: `transports/`), and resuming (`resume.py`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import orjson

from ...client import ServerAddress, ServerClient
from ...rollouts.attempts import RetryPolicy, agent_for
from .batches import BatchForming
from .config import EnvConfig, OrchestratorConfig
from .dispatch import Dispatching
from .errors import OrchestratorError, StepSignalError
from .groups import Group, VersionChanged
from .metrics import Occupancy, SlotClient
from .policy_versions import AdapterLoadError, Loader, PolicyVersions
from .resume import ResumeError, repair_history, resume_point
from .sources import EnvMixer, load_sources
from .transports.folders import MARKER, Batch, StepFolders


class Orchestrator(Dispatching, BatchForming):
    """Forms training batches from a stack's agents and keeps inference within the staleness bounds.

    `registry` names the stack's servers (agents to run tasks, model servers to hot-load); `output`
    is the run's folder (history.jsonl, failures.jsonl, and steps/ for the step-folder transport);
    `loader` replaces the LoRA hot-load of a finished step (co-locate mode publishes it in memory).
    """

    def __init__(self, config: OrchestratorConfig, registry: Mapping[str, ServerAddress], output: str | Path, *,
                 log: Callable[[str], None] = print, loader: Loader | None = None) -> None:
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
        self.versions = PolicyVersions(self.registry, config.model_servers, config.adapter_name, log, loader)
        self.policy = RetryPolicy(max_attempts=config.max_attempts, timeout_s=config.timeout_s,
                                  budget_s=config.budget_s)
        self.version = 0
        self.next_step = 1
        self.done_at: dict[int, float] = {}  # version -> when it became current
        self.dispatch_log: deque[tuple[int, int]] = deque(maxlen=100_000)  # (tag, version) per dispatch, for tests
        self._dispatched = 0
        self._events: asyncio.Queue[Group | VersionChanged] | None = None
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

    def _agent(self, env: EnvConfig) -> str | None:
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
        else:
            self.versions.carry(step)
        if self._record_finish:  # in-process batches kept on disk: a resumed run knows what was applied
            await asyncio.to_thread(self.folders.finish, step, adapter_path or None)
        self.version = step
        self.done_at[step] = time.monotonic()
        if self._events is not None:
            self._events.put_nowait(VersionChanged(step))
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

    def served_version(self) -> str | None:
        """The model_version of the newest adapter loaded (None: the base model, by its own name)."""
        loaded = {step: version for version, step in self.versions.steps.items() if step > 0}
        return loaded[max(loaded)] if loaded else None

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
                await asyncio.to_thread(self.folders.publish, batch)
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
            await asyncio.to_thread(self.folders.publish, batch)

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
            if self.versions.adapter is None:  # resumed after steps that all trained nothing: still the base
                self.versions.carry(self.version)
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


__all__ = ["Batch", "Orchestrator", "OrchestratorError", "StepSignalError"]
