"""One asyncio interface to workspaces, whoever hosts them: this machine (`LocalProvider`) or Ray
actors over a cluster (`RayProvider`, in ray_provider.py). An environment holds a provider and
keeps only workspace ids (strings) in its session state.

Every method may raise `SandboxError` (the sandbox or the provider failed: an infrastructure error,
an `env_error` of the rollout) or `FileAccessError` (the path was not there or not allowed: the
caller's fault, shown to the model). A command that fails, times out or is killed is not an error:
its `SandboxResult` says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from typing import Any, Callable, Protocol, TypeVar, runtime_checkable

from .isolation import SandboxResult
from .workspace import LocalWorkspaces, WorkspaceLimits

T = TypeVar("T")


@runtime_checkable
class WorkspaceProvider(Protocol):
    async def prepare(self) -> dict[str, Any]: ...

    async def open(self, template: str | None = None, hide: tuple[str, ...] = ()) -> str: ...

    async def exec(self, ws_id: str, command: str, timeout_s: float | None = None, stdin: bytes = b"", *,
                   files: dict[str, str | bytes] | None = None, read_only: tuple[tuple[str, str], ...] = (),
                   output_bytes: int | None = None) -> SandboxResult: ...

    async def read_file(self, ws_id: str, path: str, max_bytes: int = 1_000_000) -> str: ...

    async def write_file(self, ws_id: str, path: str, content: str) -> None: ...

    async def snapshot(self, ws_id: str, name: str = "default") -> None: ...

    async def reset(self, ws_id: str, name: str | None = None) -> None: ...

    async def close(self, ws_id: str) -> None: ...

    async def warm(self, template: str | None = None, count: int | None = None) -> None: ...

    def shutdown(self) -> None: ...


class LocalProvider:
    """Workspaces on this machine; blocking work in a thread pool, at most `max_concurrent` commands at once."""

    def __init__(self, limits: WorkspaceLimits | None = None, *, max_concurrent: int = 8, **options: Any) -> None:
        self.workspaces = LocalWorkspaces(limits, **options)
        self.max_concurrent = max_concurrent
        self._threads = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent + 2,
                                                              thread_name_prefix="workspace")
        self._semaphores: dict[int, asyncio.Semaphore] = {}

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.get(id(loop))
        if semaphore is None:
            semaphore = self._semaphores[id(loop)] = asyncio.Semaphore(self.max_concurrent)
        return semaphore

    async def _call(self, function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async with self._semaphore():
            future = asyncio.get_running_loop().run_in_executor(self._threads, functools.partial(function, *args, **kwargs))
            # A cancelled caller does not cut a command short: the thread finishes and its result is dropped.
            return await asyncio.shield(future)

    async def prepare(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.workspaces.info)

    async def open(self, template: str | None = None, hide: tuple[str, ...] = ()) -> str:
        return await self._call(self.workspaces.open, template, hide)

    async def exec(self, ws_id: str, command: str, timeout_s: float | None = None, stdin: bytes = b"", *,
                   files: dict[str, str | bytes] | None = None, read_only: tuple[tuple[str, str], ...] = (),
                   output_bytes: int | None = None) -> SandboxResult:
        return await self._call(self.workspaces.exec, ws_id, command, timeout_s, stdin, files=files,
                                read_only=read_only, output_bytes=output_bytes)

    async def read_file(self, ws_id: str, path: str, max_bytes: int = 1_000_000) -> str:
        return await self._call(self.workspaces.read_file, ws_id, path, max_bytes)

    async def write_file(self, ws_id: str, path: str, content: str) -> None:
        await self._call(self.workspaces.write_file, ws_id, path, content)

    async def snapshot(self, ws_id: str, name: str = "default") -> None:
        await self._call(self.workspaces.snapshot, ws_id, name)

    async def reset(self, ws_id: str, name: str | None = None) -> None:
        await self._call(self.workspaces.reset, ws_id, name)

    async def close(self, ws_id: str) -> None:
        await asyncio.get_running_loop().run_in_executor(self._threads, self.workspaces.close, ws_id)

    async def warm(self, template: str | None = None, count: int | None = None) -> None:
        await asyncio.to_thread(self.workspaces.warm, template, count)

    def shutdown(self) -> None:
        self.workspaces.shutdown()
        self._threads.shutdown(wait=False, cancel_futures=True)


def make_provider(kind: str, limits: WorkspaceLimits | None = None, **options: Any) -> WorkspaceProvider:
    """`local` or `ray` (options: what LocalWorkspaces takes, plus the provider's own)."""
    if kind == "local":
        return LocalProvider(limits, **options)
    if kind == "ray":
        from .ray_provider import RayProvider

        return RayProvider(limits, **options)
    raise ValueError(f"unknown workspace provider {kind!r}: local or ray")
