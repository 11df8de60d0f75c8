"""RolloutClient: a trainer asks an agent server for verified rollouts, grouped by task.

    client = RolloutClient("http://127.0.0.1:8123")           # an agent's URL, a registry, or a registry file
    groups = client.run_sync(rows, repeats=4, concurrency=16)  # from sync code (a trainer's step)
    groups = await client.run(rows, repeats=4)                 # from async code
    groups[i][k]  # the k-th rollout of rows[i]: a /run answer with reward, status, response, sequences

Every rollout is one `POST /run` through `ServerClient`. Infrastructure failures (`model_error`,
`env_error`, `timeout`, an agent that cannot be reached or answers 5xx) are retried up to
`max_attempts` times per rollout; a row the agent rejects (4xx) is not retried. A rollout that never
succeeds is never handed over as a reward: `run` raises `RolloutsFailed` (which carries the rollouts
that did succeed and one `RolloutFailure` per failed slot), and `run_detailed` returns both
separately without raising, for trainers that prefer to drop or mask the failed slots themselves.

All HTTP runs on one private event loop in a daemon thread owned by the client, so `run_sync` works
from plain sync code, repeatedly, and also from a thread that is running its own event loop (it then
blocks that loop until the rollouts are back: inside async code, `await run(...)` instead). `run`
awaits the same private loop, so one client serves any number of callers, threads and event loops.
Call `close()` (or use `with RolloutClient(...) as client:`) when done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Coroutine, Mapping, Sequence, TypeVar

from pydantic import ValidationError

from ..client import ServerAddress, ServerClient, load_registry_file, registry_from_json
from ..errors import validation_errors
from ..schema import RunRequest
from .attempts import (
    FailedAttempt,
    RetryPolicy,
    agent_for,
    UnknownAgent,
    build_payload,
    check_agent_refs,
    group_id_for,
    rollout_id_for,
    run_rollout,
)

log = logging.getLogger("rollgym.rollouts.rollout_client")

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutFailure:
    """One rollout slot that never succeeded: which row and repeat, and the last attempt's cause.

    `status` is a /run failure status (`model_error`, `env_error`, `timeout`), `agent_error` (the
    agent could not be reached or answered 5xx) or `rejected` (the agent refused the row with a 4xx:
    a bad row, not retried).
    """

    index: int
    repeat: int
    rollout_id: str
    group_id: str
    status: str
    error: str | None
    attempts: int

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "repeat": self.repeat, "rollout_id": self.rollout_id, "group_id": self.group_id,
                "status": self.status, "error": self.error, "attempts": self.attempts}


@dataclass
class RolloutResult:
    """What `run_detailed` returns: the successful rollouts per row, and the slots that failed.

    `groups[i]` holds the rollouts of `rows[i]` that succeeded, in repeat order (so it is shorter than
    the repeats asked for when some failed); `failures` lists the failed slots. Nothing is filled in.
    """

    groups: list[list[dict[str, Any]]]
    failures: list[RolloutFailure]
    slots: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return not self.failures

    def get(self, index: int, repeat: int) -> dict[str, Any] | None:
        """The rollout of row `index`, repeat `repeat`, or None when that slot failed."""
        return self.slots.get((index, repeat))


class RolloutsFailed(RuntimeError):
    """Some rollouts never succeeded within `max_attempts`; no reward was made up for them.

    `failures` lists the failed slots; `groups` holds every rollout that did succeed, per row (as in
    `RolloutResult.groups`), so a caller can still use them deliberately.
    """

    def __init__(self, failures: list[RolloutFailure], groups: list[list[dict[str, Any]]], total: int) -> None:
        counts = Counter(failure.status for failure in failures)
        summary = ", ".join(f"{status} {count}" for status, count in counts.most_common())
        first = failures[0]
        super().__init__(
            f"{len(failures)} of {total} rollouts failed after retries ({summary}); first: rows[{first.index}] "
            f"repeat {first.repeat} ({first.rollout_id}) after {first.attempts} attempt(s): {first.error}"
        )
        self.failures = failures
        self.groups = groups


class _LoopThread:
    """A private event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name="rollgym-rollout-client", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.thread.ident

    def stop(self, client: ServerClient | None, timeout_s: float = 10.0) -> None:
        """Close `client` on the loop, stop the loop and join the thread (idempotent)."""
        if self.loop.is_closed():
            return
        if self.loop.is_running() and not self.in_loop_thread():
            if client is not None:
                try:
                    self.submit(client.close()).result(timeout_s)
                except Exception:  # noqa: BLE001 - best effort at shutdown
                    pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)
        if not self.loop.is_running():
            self.loop.close()


def _shutdown(runner: _LoopThread, client: ServerClient) -> None:
    runner.stop(client)


class RolloutClient:
    """Calls an agent server's `POST /run` for many task rows, `repeats` times each, with bounded retries.

    `target` is an agent's base URL (every row goes to it; `auth_token` is its bearer token), a
    registry (`{name: ServerAddress}` or its JSON form, as `rollgym run --registry-file` writes it),
    or the path of such a registry file. With a registry, each row goes to the agent named by its
    `agent_ref` (as `prepare-data` stamps it), else to `agent`, else to the registry's only agent.

    `params` are merged into every row's `responses_create_params` (e.g. `{"temperature": 1.0,
    "max_output_tokens": 256}`); `run(..., params=)` adds more for one call. `timeout_s` bounds one
    rollout; `max_attempts` is the tries per rollout for infrastructure failures; `http_retries` is
    how often one HTTP call is retried on connection errors, 429 and 5xx before that counts as a
    failed attempt; `retry_backoff_s` scales the jittered exponential wait between attempts;
    `rollout_budget_s` bounds all the attempts of one rollout together, waits included.
    `skip_verification`: the agent does not call `/verify`; each rollout has `reward: None` and
    `verification: "skipped"` (for SFT or filtering data, not for reward-based training).
    """

    def __init__(
        self,
        target: str | Path | Mapping[str, Any],
        agent: str | None = None,
        *,
        timeout_s: float = 3600.0,
        max_attempts: int = 3,
        params: Mapping[str, Any] | None = None,
        auth_token: str | None = None,
        http_retries: int = 2,
        retry_backoff_s: float = 0.5,
        concurrency: int = 32,
        rollout_budget_s: float | None = None,
        skip_verification: bool = False,
    ) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if rollout_budget_s is not None and rollout_budget_s <= 0:
            raise ValueError("rollout_budget_s must be positive")
        self.registry, self.url_target = _registry(target, auth_token)
        self.agent = self._default_agent(agent)
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.params = dict(params or {})
        self.http_retries = http_retries
        self.retry_backoff_s = retry_backoff_s
        self.concurrency = concurrency
        self.rollout_budget_s = rollout_budget_s
        self.skip_verification = skip_verification
        self._lock = threading.Lock()
        self._runner: _LoopThread | None = None
        self._client: ServerClient | None = None
        self._finalizer: weakref.finalize | None = None

    # ------------------------------------------------------------------ public API

    async def run(
        self, rows: Sequence[Mapping[str, Any]], repeats: int | Sequence[int] = 1, concurrency: int | None = None,
        *, params: Mapping[str, Any] | None = None,
    ) -> list[list[dict[str, Any]]]:
        """`repeats` rollouts of every row, grouped per row in input order; raises `RolloutsFailed`.

        `repeats` is one count for all rows or one per row. Each rollout carries `group_id` (the row's
        own, else `L{index+1:06d}-{hash}`, the id the collector gives the same row as line index+1 of a
        task file) and `rollout_id` (`{group_id}-r{repeat}`); see rollgym.rollouts.attempts.
        """
        repeats = repeats if isinstance(repeats, int) else list(repeats)
        result = await self.run_detailed(rows, repeats, concurrency, params=params)
        return _raise_on_failure(result, _total(rows, repeats))

    async def run_detailed(
        self, rows: Sequence[Mapping[str, Any]], repeats: int | Sequence[int] = 1, concurrency: int | None = None,
        *, params: Mapping[str, Any] | None = None,
    ) -> RolloutResult:
        """Like `run`, but failed slots are returned in `RolloutResult.failures` instead of raising."""
        jobs = self._jobs(rows, repeats, params)
        runner, client = self._ensure_runner()
        future = runner.submit(self._run_jobs(client, jobs, len(rows), concurrency or self.concurrency))
        return await asyncio.wrap_future(future)

    def run_sync(
        self, rows: Sequence[Mapping[str, Any]], repeats: int | Sequence[int] = 1, concurrency: int | None = None,
        *, params: Mapping[str, Any] | None = None,
    ) -> list[list[dict[str, Any]]]:
        """`run` for sync code: blocks until every rollout is back; raises `RolloutsFailed`."""
        repeats = repeats if isinstance(repeats, int) else list(repeats)
        result = self.run_detailed_sync(rows, repeats, concurrency, params=params)
        return _raise_on_failure(result, _total(rows, repeats))

    def run_detailed_sync(
        self, rows: Sequence[Mapping[str, Any]], repeats: int | Sequence[int] = 1, concurrency: int | None = None,
        *, params: Mapping[str, Any] | None = None,
    ) -> RolloutResult:
        """`run_detailed` for sync code."""
        jobs = self._jobs(rows, repeats, params)
        runner, client = self._ensure_runner()
        if runner.in_loop_thread():
            raise RuntimeError("run_sync was called from the RolloutClient's own event loop; await run() there")
        future = runner.submit(self._run_jobs(client, jobs, len(rows), concurrency or self.concurrency))
        try:
            return future.result()
        except BaseException:
            future.cancel()  # a KeyboardInterrupt in the caller stops the rollouts in flight too
            raise

    def close(self) -> None:
        """Close the HTTP session and stop the private loop. The client starts a new one if used again."""
        with self._lock:
            runner, client, finalizer = self._runner, self._client, self._finalizer
            if runner is not None and runner.in_loop_thread():
                raise RuntimeError("close() was called from the RolloutClient's own event loop; use aclose()")
            self._runner = self._client = self._finalizer = None
        if finalizer is not None:
            finalizer.detach()
        if runner is not None:
            runner.stop(client)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "RolloutClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ internals

    def _default_agent(self, agent: str | None) -> str | None:
        if self.url_target:
            return "agent"
        if agent is not None:
            if agent not in self.registry:
                known = ", ".join(sorted(self.registry)) or "none"
                raise ValueError(f"agent {agent!r} is not in the registry (servers: {known})")
            return agent
        agents = [name for name, address in self.registry.items() if address.role in ("agents", "")]
        return agents[0] if len(agents) == 1 else None

    def _ensure_runner(self) -> tuple[_LoopThread, ServerClient]:
        with self._lock:
            if self._runner is None or self._client is None:
                self._runner = _LoopThread()
                self._client = ServerClient(self.registry, timeout_s=self.timeout_s, max_retries=self.http_retries)
                self._finalizer = weakref.finalize(self, _shutdown, self._runner, self._client)
            return self._runner, self._client

    def _jobs(self, rows: Sequence[Mapping[str, Any]], repeats: int | Sequence[int],
              params: Mapping[str, Any] | None) -> list[_Job]:
        """Validate every row before anything is sent; one job per (row, repeat)."""
        if isinstance(rows, Mapping):
            raise TypeError("rows must be a list of task rows, not one row")
        counts = [repeats] * len(rows) if isinstance(repeats, int) else list(repeats)
        if len(counts) != len(rows):
            raise ValueError(f"repeats has {len(counts)} counts for {len(rows)} rows")
        if any(count < 1 for count in counts):
            raise ValueError("repeats must be at least 1")
        merged = {**self.params, **(params or {})}
        jobs = []
        for index, (row, count) in enumerate(zip(rows, counts)):
            if not isinstance(row, Mapping):
                raise TypeError(f"rows[{index}] is a {type(row).__name__}, not a task row (a dict)")
            row = dict(row)
            try:
                RunRequest.model_validate(row)
            except ValidationError as exc:
                first = validation_errors(exc.errors())[0]
                raise ValueError(f"rows[{index}]: field '{first['field']}': {first['message']}") from None
            agent = self.agent if self.url_target else agent_for(row, self.agent or "")
            if not self.url_target:
                try:
                    check_agent_refs([(f"rows[{index}]", row)], self.registry)
                except UnknownAgent as exc:
                    raise ValueError(str(exc)) from None
            if not agent:
                agents = [name for name, address in self.registry.items() if address.role in ("agents", "")]
                raise ValueError(f"rows[{index}] names no agent (agent_ref) and the registry has "
                                 f"{len(agents)} agents ({', '.join(agents) or 'none'}): pass agent=")
            group_id = group_id_for(row, index + 1)
            for repeat in range(count):
                rollout_id = rollout_id_for(group_id, repeat)
                payload = build_payload(row, merged, group_id, rollout_id, skip_verification=self.skip_verification)
                jobs.append(_Job(index, repeat, agent, group_id, payload))
        return jobs

    async def _run_jobs(self, client: ServerClient, jobs: list[_Job], rows: int, concurrency: int) -> RolloutResult:
        semaphore = asyncio.Semaphore(concurrency)

        async def one(job: _Job) -> dict[str, Any] | RolloutFailure:
            async with semaphore:
                return await self._rollout(client, job)

        outcomes = await asyncio.gather(*(one(job) for job in jobs))
        groups: list[list[dict[str, Any]]] = [[] for _ in range(rows)]
        failures = []
        slots = {}
        for job, outcome in zip(jobs, outcomes):
            if isinstance(outcome, RolloutFailure):
                failures.append(outcome)
            else:
                groups[job.index].append(outcome)
                slots[(job.index, job.repeat)] = outcome
        return RolloutResult(groups, failures, slots)

    async def _rollout(self, client: ServerClient, job: _Job) -> dict[str, Any] | RolloutFailure:
        """One rollout under the shared retry policy (rollgym.rollouts.attempts), as the collector does."""
        policy = RetryPolicy(max_attempts=self.max_attempts, timeout_s=self.timeout_s, backoff_s=self.retry_backoff_s,
                             backoff_max_s=20 * self.retry_backoff_s, budget_s=self.rollout_budget_s)

        def failed(attempt: FailedAttempt) -> None:
            log.warning("rollout %s attempt %d/%d failed (%s): %s%s", attempt.rollout_id, attempt.attempt,
                        self.max_attempts, attempt.status, attempt.error, "" if attempt.final else "; retrying")

        rollout, final = await run_rollout(client, job.agent, job.payload, policy,
                                           where={"index": job.index, "repeat": job.repeat}, on_failure=failed)
        if rollout is not None:
            return rollout
        assert final is not None
        return RolloutFailure(job.index, job.repeat, final.rollout_id, final.group_id, final.status, final.error,
                              final.attempt)


@dataclass
class _Job:
    index: int
    repeat: int
    agent: str
    group_id: str
    payload: dict[str, Any]


def _registry(target: str | Path | Mapping[str, Any], auth_token: str | None) -> tuple[dict[str, ServerAddress], bool]:
    """(registry, whether the target was one agent URL)."""
    if isinstance(target, str) and target.startswith(("http://", "https://")):
        return {"agent": ServerAddress(url=target.rstrip("/"), role="agents", auth_token=auth_token)}, True
    if isinstance(target, (str, Path)):
        path = Path(target)
        if not path.is_file():
            raise ValueError(f"{target!s} is neither an http(s) URL nor a registry file")
        return load_registry_file(path, auth_token=auth_token), False
    if not isinstance(target, Mapping) or not target:
        raise ValueError("target must be an agent URL, a registry {name: address} or a registry file")
    registry = {}
    for name, address in target.items():
        registry[name] = address if isinstance(address, ServerAddress) else registry_from_json({name: address})[name]
    return registry, False


def _total(rows: Sequence[Any], repeats: int | Sequence[int]) -> int:
    return len(rows) * repeats if isinstance(repeats, int) else sum(repeats)


def _raise_on_failure(result: RolloutResult, total: int) -> list[list[dict[str, Any]]]:
    if result.failures:
        raise RolloutsFailed(result.failures, result.groups, total)
    return result.groups


__all__ = ["RolloutClient", "RolloutFailure", "RolloutResult", "RolloutsFailed"]
