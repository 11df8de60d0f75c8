"""Workspaces spread over a Ray cluster: one actor per host slot, each a `LocalWorkspaces` on its node.

For users who outgrow one machine: `RayProvider(hosts=4)` starts four actors (spread over the
cluster's nodes, each asking for `num_cpus`), opens each new workspace on the actor with the fewest
open, and sends every later call of that workspace to it (the id says which: "<host>-<id>"). Each
actor runs its node's launcher, as root on that node when Ray runs as root there; the isolation is the
node's. The driver needs `ray.init()` (or an address) before the first call.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .isolation import SandboxError, SandboxResult
from .workspace import LocalWorkspaces, WorkspaceLimits


class WorkspaceHost:
    """The actor: a node's workspaces (methods run on the actor's threads, `max_concurrency` at once)."""

    def __init__(self, limits: WorkspaceLimits | None, options: dict[str, Any]) -> None:
        self.workspaces = LocalWorkspaces(limits, **options)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.workspaces, method)(*args, **kwargs)

    def node(self) -> dict[str, Any]:
        import os
        import socket

        return {"host": socket.gethostname(), "pid": os.getpid(), **self.workspaces.info()}


class RayProvider:
    def __init__(self, limits: WorkspaceLimits | None = None, *, hosts: int = 1, num_cpus: float = 1.0,
                 max_concurrent: int = 8, address: str | None = None, **options: Any) -> None:
        self.limits, self.options = limits, options
        self.hosts_wanted, self.num_cpus, self.max_concurrent, self.address = hosts, num_cpus, max_concurrent, address
        self._actors: list[Any] = []
        self._open: dict[str, int] = {}
        self._lock = asyncio.Lock()

    async def _start(self) -> list[Any]:
        async with self._lock:
            if not self._actors:
                import ray

                if not ray.is_initialized():
                    ray.init(address=self.address or "auto", log_to_driver=False, configure_logging=False)
                actor = ray.remote(WorkspaceHost).options(num_cpus=self.num_cpus, max_concurrency=self.max_concurrent,
                                                          scheduling_strategy="SPREAD")
                self._actors = [actor.remote(self.limits, self.options) for _ in range(self.hosts_wanted)]
            return self._actors

    async def _on(self, host: int, method: str, *args: Any, **kwargs: Any) -> Any:
        import ray

        actors = await self._start()
        try:
            return await actors[host].call.remote(method, *args, **kwargs)
        except ray.exceptions.RayActorError as exc:
            raise SandboxError(f"workspace host {host} is gone: {exc}") from None

    def _host(self, ws_id: str) -> tuple[int, str]:
        host, _, local = ws_id.partition("-")
        if not host.isdigit() or not local:
            raise SandboxError(f"not a workspace id of this provider: {ws_id!r}")
        return int(host), local

    async def prepare(self) -> dict[str, Any]:
        actors = await self._start()
        nodes = await asyncio.gather(*(actor.node.remote() for actor in actors))
        return {"provider": "ray", "hosts": nodes}

    async def open(self, template: str | None = None, hide: tuple[str, ...] = ()) -> str:
        await self._start()
        counts = [0] * len(self._actors)
        for host in self._open.values():
            counts[host] += 1
        host = counts.index(min(counts))
        ws_id = f"{host}-{await self._on(host, 'open', template, hide)}"
        self._open[ws_id] = host
        return ws_id

    async def exec(self, ws_id: str, command: str, timeout_s: float | None = None, stdin: bytes = b"", *,
                   files: dict[str, str | bytes] | None = None, read_only: tuple[tuple[str, str], ...] = (),
                   output_bytes: int | None = None) -> SandboxResult:
        host, local = self._host(ws_id)
        return await self._on(host, "exec", local, command, timeout_s, stdin, files=files, read_only=read_only,
                              output_bytes=output_bytes)

    async def read_file(self, ws_id: str, path: str, max_bytes: int = 1_000_000) -> str:
        host, local = self._host(ws_id)
        return await self._on(host, "read_file", local, path, max_bytes)

    async def write_file(self, ws_id: str, path: str, content: str) -> None:
        host, local = self._host(ws_id)
        await self._on(host, "write_file", local, path, content)

    async def snapshot(self, ws_id: str, name: str = "default") -> None:
        host, local = self._host(ws_id)
        await self._on(host, "snapshot", local, name)

    async def reset(self, ws_id: str, name: str | None = None) -> None:
        host, local = self._host(ws_id)
        await self._on(host, "reset", local, name)

    async def close(self, ws_id: str) -> None:
        host, local = self._host(ws_id)
        self._open.pop(ws_id, None)
        await self._on(host, "close", local)

    async def warm(self, template: str | None = None, count: int | None = None) -> None:
        actors = await self._start()
        await asyncio.gather(*(self._on(i, "warm", template, count) for i in range(len(actors))))

    def shutdown(self) -> None:
        import ray

        for actor in self._actors:
            try:
                ray.get(actor.call.remote("shutdown"), timeout=30)
            except Exception:  # noqa: BLE001 - a dead host has nothing left to clean
                pass
            ray.kill(actor)
        self._actors = []
