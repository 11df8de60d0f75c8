"""A stack and a rollout collection on a Ray cluster: `rollgym run --ray`, `collect-rollouts --ray`.

Ray is an optional extra (`pip install 'rollgym[ray]'`); nothing else in rollgym imports it.

**Servers as actors.** `RayStack` starts every replica of every server of a stack as a Ray actor,
with the resources its config asks for (`ray_resources: {num_cpus: 1, num_gpus: 1}`, Ray's actor
options) and the SPREAD strategy, so replicas land on different nodes. Each actor binds a socket
on its node's address first; once all have, the registry (one URL per replica) is known and every
actor builds its server with it and serves it with uvicorn on a thread. Servers on a node address
beyond loopback need a bearer token: a stack whose configs set none gets one random token for all
its servers, carried in the registry. Actors are named `name[i]` in the namespace `rollgym` and
live as long as the driver (`rollgym run --ray`).

**Collection by sharded actors.** `collect_on_ray` reads the tasks and the output already written
(resuming, as the local collector does), deals the missing rollouts' task groups round-robin to
several collector actors, and streams each finished rollout (and each failed attempt) back to the
driver, which alone appends to the one output JSONL and failures file as they arrive. A collector
actor that dies has its unfinished rollouts dealt to a fresh actor (twice at most); a driver that
dies leaves a valid output, and rerunning the same command resumes with nothing duplicated.
"""

from __future__ import annotations

import asyncio
import functools
import math
import secrets
import socket
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Mapping

import aiohttp

from ..client import ServerAddress, ServerClient, registry_from_json
from ..rollouts.attempts import FailedAttempt
from ..rollouts.collector import CollectOptions, Collector, Task, check_routes, read_tasks
from ..rollouts.sink import RolloutSink, scan_output
from ..config import StackConfig
from .backend import StackBackend, wait_healthy
from .launcher import LaunchError, replica_name
from ..server import is_loopback

NAMESPACE = "rollgym"
SHARD_RESTARTS = 2  # fresh actors for one shard's rollouts after its actor dies


def import_ray() -> Any:
    """The `ray` module, or a LaunchError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise LaunchError("Ray is not installed: pip install 'rollgym[ray]'") from None
    return ray


def connect(address: str | None) -> bool:
    """Join the Ray cluster at `address` unless this process already has; True if this call did.

    `address`: None or "" (Ray's default: the cluster started on this machine with `ray start`, else a
    new local one), "auto" (a running cluster), "local" (a new local one), "HOST:PORT", "ray://HOST:PORT".
    """
    ray = import_ray()
    if ray.is_initialized():
        return False
    try:
        ray.init(address=address or None, namespace=NAMESPACE, log_to_driver=True, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise LaunchError(f"cannot join the Ray cluster at {address or 'the default address'}: {exc}") from None
    return True


# --- servers as actors -----------------------------------------------------------------------------


class _ServerReplica:
    """One replica of a server, inside a Ray actor: binds a socket, then serves on a thread."""

    def __init__(self, name: str, replica: int, port: int) -> None:
        import ray

        self.name, self.replica = name, replica
        self.host = ray.util.get_node_ip_address()
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, port))
        self.sock.listen(4096)
        self.server: Any = None
        self.thread: threading.Thread | None = None
        self.stopped = threading.Event()

    def address(self) -> tuple[str, int]:
        """(node address, port) this replica listens on."""
        return self.host, self.sock.getsockname()[1]

    def start(self, stack: dict[str, Any], timeout_s: float) -> None:
        """Build the server with the stack's registry and serve it; returns once it is listening."""
        import uvicorn

        from .serve import build_replica, uvicorn_config

        server, app = build_replica(stack, self.name, self.replica)  # ServerStartError reaches the driver
        self.server = uvicorn.Server(uvicorn_config(server, app, loop="asyncio"))

        def serve() -> None:
            try:
                self.server.run(sockets=[self.sock])
            finally:
                self.stopped.set()

        self.thread = threading.Thread(target=serve, name=f"rollgym-{self.name}", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if self.stopped.is_set():
                raise RuntimeError(f"server '{self.name}' stopped during its startup (see the actor's log)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server '{self.name}' did not start in {timeout_s:g} s")
            time.sleep(0.01)

    def wait_stopped(self) -> int:
        """Blocks until the server stops; the driver keeps one of these calls pending per actor."""
        self.stopped.wait()
        return 0

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
            self.stopped.wait(timeout=10)

    def resources(self) -> dict[str, Any]:
        """What Ray gave this actor, and where it runs."""
        import ray

        context = ray.get_runtime_context()
        return {"resources": context.get_assigned_resources(), "node_id": context.get_node_id(), "host": self.host}


@functools.cache
def _server_actor_class() -> Any:
    return import_ray().remote(_ServerReplica)


class RayStack(StackBackend):
    """A stack whose servers are Ray actors; the same interface as `launcher.Stack` for the CLI."""

    start_timeout_s = 180.0

    def __init__(self, config: StackConfig, address: str | None = None, *,
                 log: Callable[[str], None] | None = None) -> None:
        super().__init__(config, log=log)
        self.address = address
        self.actors: dict[str, Any] = {}  # process name (`name` or `name[i]`) -> actor handle
        self.run_id = secrets.token_hex(3)
        self._watch: dict[Any, str] = {}  # pending wait_stopped() ref -> process name
        self._exited: dict[str, int] = {}
        self._connected = False

    def start(self, timeout_s: float | None = None) -> dict[str, ServerAddress]:
        """Join the cluster, start every replica as an actor and wait until all answer /health."""
        self._connected = connect(self.address)
        return super().start(timeout_s)

    def _launch(self, timeout_s: float) -> None:
        actor_class = _server_actor_class()
        for name, spec in self.config.servers.items():
            base_port = int(spec.options.get("port", 0))
            for index in range(spec.replicas):
                process_name = replica_name(name, index, spec.replicas)
                self.actors[process_name] = actor_class.options(
                    name=f"{process_name}@{self.run_id}", namespace=NAMESPACE, scheduling_strategy="SPREAD",
                    max_concurrency=4, **spec.ray_resources,
                ).remote(name, index, base_port + index if base_port else 0)
                self._server_of[process_name] = name
        addresses = dict(zip(self.actors, self._get([a.address.remote() for a in self.actors.values()], timeout_s)))
        stack = self._stack_payload(addresses)
        pending = [self.actors[p].start.remote(stack, timeout_s) for p in self.actors]
        self._get(pending, timeout_s)
        for process_name, actor in self.actors.items():
            self._watch[actor.wait_stopped.remote()] = process_name
        asyncio.run(self._wait_healthy(timeout_s))

    def _get(self, refs: list[Any], timeout_s: float) -> list[Any]:
        ray = import_ray()
        try:
            return ray.get(refs, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"the servers' actors did not start in {timeout_s:g} s: does the cluster have "
                              "the resources their ray_resources ask for?") from None
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            raise LaunchError(f"a server actor failed: {type(cause).__name__}: {cause}") from None

    def _stack_payload(self, addresses: dict[str, tuple[str, int]]) -> dict[str, Any]:
        """The stack file the servers are built from: their specs as bound, the registry, one secret."""
        servers = {name: replace(spec, options=dict(spec.options)) for name, spec in self.config.servers.items()}
        beyond_loopback = any(not is_loopback(host) for host, _ in addresses.values())
        token = secrets.token_urlsafe(32) if beyond_loopback else None
        for name, spec in servers.items():
            host = addresses[replica_name(name, 0, spec.replicas)][0]
            spec.options["host"] = host  # the server's own check: beyond loopback needs a token
            spec.options.pop("port", None)
            if token and not spec.options.get("auth_token"):
                spec.options["auth_token"] = token
            urls, hosts = [], set()
            for index in range(spec.replicas):
                replica_host, port = addresses[replica_name(name, index, spec.replicas)]
                hosts.add(replica_host)
                urls.append(f"http://{f'[{replica_host}]' if ':' in replica_host else replica_host}:{port}")
            # The default SQLite file is per node: replicas on several nodes share sessions only
            # through a session_db the config names (a path every node sees).
            shared = len(hosts) == 1 or bool(spec.options.get("session_db"))
            self.registry[name] = ServerAddress.replicated(
                urls, role=spec.role, auth_token=spec.options.get("auth_token"),
                shared_sessions=spec.replicas > 1 and spec.options.get("session_store") == "sqlite" and shared,
            )
        if token:
            self.log("rollgym: servers listen on cluster addresses; they require a bearer token, "
                     "generated for this stack and written in its registry")
        return {
            "servers": StackConfig(servers).to_json(),
            "registry": {name: address.to_json() for name, address in self.registry.items()},
            "secret": secrets.token_hex(32),
        }

    async def _wait_healthy(self, timeout_s: float) -> None:
        """Every replica answers /health from here (the driver reaches the URLs it publishes)."""
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            for name, address in self.registry.items():
                for url in address.urls:
                    await wait_healthy(http, name, url, address, deadline, attempt_s=2.0, pause_s=0.05)

    def _exit_codes(self) -> dict[str, int]:
        """The actors that have stopped or died (code 1: killed, node lost)."""
        ray = import_ray()
        if self._watch:
            ready, _ = ray.wait(list(self._watch), num_returns=len(self._watch), timeout=0)
            for ref in ready:
                process_name = self._watch.pop(ref)
                try:
                    self._exited[process_name] = ray.get(ref)
                except ray.exceptions.RayError:
                    self._exited[process_name] = 1
        return dict(self._exited)

    def exit_words(self, code: int) -> str:
        return "stopped"

    def _kill_one(self, process_name: str) -> None:
        import_ray().kill(self.actors[process_name], no_restart=True)

    def stop(self, grace_s: float = 8.0) -> None:
        """Stop every server, kill its actor, and leave the cluster if this stack joined it."""
        ray = import_ray()
        if not ray.is_initialized():
            return
        stops = [actor.stop.remote() for actor in self.actors.values()]
        if stops:
            ray.wait(stops, num_returns=len(stops), timeout=grace_s)
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors.clear()
        self._watch.clear()
        if self._connected:
            ray.shutdown()
            self._connected = False


# --- collection by sharded actors ------------------------------------------------------------------


class _CollectorShard:
    """A Ray actor that runs rollouts of one shard and streams each outcome back as it comes."""

    async def run(self, registry: dict[str, Any], agent: str, options: CollectOptions,
                  jobs: list[tuple[Task, int]], concurrency: int) -> Any:
        """Yields batches of ("rollout", rollout) and ("failure", failure record) items."""
        client = ServerClient(registry_from_json(registry), timeout_s=options.timeout_s, max_retries=2)
        collector = Collector(client, agent, options, log=lambda message: print(f"rollgym: {message}", file=sys.stderr))
        queue: asyncio.Queue = asyncio.Queue()
        semaphore = asyncio.Semaphore(concurrency)

        def failed(attempt: FailedAttempt) -> None:  # each failed attempt goes to the driver's sink
            queue.put_nowait(("failure", attempt.to_json()))

        async def one(task: Task, repeat: int) -> None:
            async with semaphore:
                rollout, _ = await collector.rollout(task, repeat, failed)  # the local collector's policy, exactly
            queue.put_nowait(("rollout", rollout) if rollout is not None else ("done", task.rollout_id(repeat)))

        workers = [asyncio.create_task(one(task, repeat)) for task, repeat in jobs]
        finished = 0
        try:
            while finished < len(workers):
                batch = [await queue.get()]
                while not queue.empty():
                    batch.append(queue.get_nowait())
                finished += sum(1 for kind, _ in batch if kind != "failure")
                yield [item for item in batch if item[0] != "done"]
            await asyncio.gather(*workers)
        finally:
            for worker in workers:
                worker.cancel()
            await client.close()


@functools.cache
def _collector_actor_class() -> Any:
    return import_ray().remote(_CollectorShard)


def collect_on_ray(registry: Mapping[str, ServerAddress], agent: str, options: CollectOptions, *,
                   address: str | None = None, collectors: int = 4,
                   log: Callable[[str], None] = print) -> dict[str, Any]:
    """Collect every missing rollout of `options` through `collectors` actors; returns the metrics
    summary (also written to disk), as `Collector.run` does. With nothing missing, Ray is not joined."""
    if collectors < 1:
        raise ValueError("collectors must be at least 1")
    driver = _Driver(registry, agent, options, collectors, log)
    joined = connect(address) if driver.missing else False
    try:
        return asyncio.run(driver.run())
    finally:
        if joined:
            import_ray().shutdown()


class _Driver:
    """The driver side of a sharded collection: deals shards, appends what comes back, resumes shards."""

    def __init__(self, registry: Mapping[str, ServerAddress], agent: str, options: CollectOptions,
                 collectors: int, log: Callable[[str], None]) -> None:
        self.registry = {name: address.to_json() for name, address in registry.items()}
        self.agent = agent
        self.options = options
        self.log = log
        self.run_id = secrets.token_hex(3)
        self.restarts = 0
        # What is there and what is missing, as the local collector reads them.
        tasks, self.problems = read_tasks(options.input, options.limit)
        check_routes(tasks, dict(registry), options, agent)
        for problem in self.problems:
            log(f"{options.input}:{problem.line}: skipped: {problem.message}")
        options.output.parent.mkdir(parents=True, exist_ok=True)
        done, note = scan_output(options.output)
        if note:
            log(note)
        self.done = done
        self.total = len(tasks) * options.repeats
        groups = [[(task, k) for k in range(options.repeats) if task.rollout_id(k) not in done] for task in tasks]
        groups = [group for group in groups if group]
        self.missing = sum(len(group) for group in groups)
        if done:
            log(f"resuming: {self.total - self.missing} of {self.total} rollouts already in {options.output}")
        # Whole task groups, dealt round-robin: a group's repeats stay on one collector.
        shards = [[job for group in groups[i::collectors] for job in group] for i in range(collectors)]
        self.shards = [shard for shard in shards if shard]

    async def run(self) -> dict[str, Any]:
        options = self.options
        concurrency = max(1, math.ceil(options.concurrency / max(1, len(self.shards))))
        self.sink = RolloutSink(options.output, done=self.done, total=self.total, repeats=options.repeats,
                                pass_threshold=options.pass_threshold, progress=options.progress, log=self.log)
        try:
            await asyncio.gather(*(self._shard(i, shard, concurrency) for i, shard in enumerate(self.shards)))
        finally:
            summary = self.sink.close(skipped_lines=len(self.problems), ray_collectors=len(self.shards),
                                      ray_collector_restarts=self.restarts)
        return summary

    async def _shard(self, index: int, jobs: list[tuple[Task, int]], concurrency: int) -> None:
        """Run one shard to its end, on fresh actors while its actor dies (bounded)."""
        ray = import_ray()
        pending = {task.rollout_id(repeat): (task, repeat) for task, repeat in jobs}
        for attempt in range(SHARD_RESTARTS + 1):
            actor = _collector_actor_class().options(
                name=f"collector-{index}.{attempt}@{self.run_id}", namespace=NAMESPACE,
                scheduling_strategy="SPREAD", num_cpus=0,
            ).remote()
            stream = actor.run.options(num_returns="streaming").remote(
                self.registry, self.agent, self.options, list(pending.values()), concurrency
            )
            try:
                async for ref in stream:
                    for kind, item in await ref:
                        self._arrived(kind, item, pending)
                return
            except ray.exceptions.RayError as exc:
                if not pending:
                    return
                if attempt == SHARD_RESTARTS:
                    raise LaunchError(
                        f"collector shard {index} died {attempt + 1} times ({type(exc).__name__}); "
                        f"{len(pending)} rollouts left: rerun the same command to resume"
                    ) from None
                self.restarts += 1
                self.log(f"collector shard {index} died ({type(exc).__name__}); "
                         f"its {len(pending)} unfinished rollouts go to a fresh actor")
            finally:
                ray.kill(actor, no_restart=True)

    def _arrived(self, kind: str, item: dict[str, Any], pending: dict[str, tuple[Task, int]]) -> None:
        rollout_id = str(item["rollout_id"])
        if kind == "failure":
            # A final failure counts once, even when a restarted shard reports the rollout again.
            self.sink.failure(item, count=not item.get("final") or pending.pop(rollout_id, None) is not None)
            return
        if self.sink.has(rollout_id) or pending.pop(rollout_id, None) is None:
            return  # never written twice
        self.sink.rollout(item)
