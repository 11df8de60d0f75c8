"""What every way of running a stack shares (local processes: launcher.py; Ray actors: ray.py).

A backend starts every replica of every server, publishes one registry, and watches its replicas;
`StackBackend` writes once the start/stop skeleton (`with backend as registry:`, stop on any failure
of the start, `startup_s`), the health wait, which server is dead, and which replicas a name means. A
backend writes `_launch` (start every replica, fill `registry`), `_exit_codes` (the replicas that have
stopped, with their codes), `_kill_one` and `stop`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any, Callable

import aiohttp

from ..client import ServerAddress
from ..config import StackConfig
from ..errors import LaunchError


class StackBackend:
    """A running stack: `with backend as registry: ...` or `start()` / `stop()`."""

    start_timeout_s: float = 120.0

    def __init__(self, config: StackConfig, *, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self.registry: dict[str, ServerAddress] = {}
        self.startup_s: float | None = None
        self._server_of: dict[str, str] = {}  # process name (`name` or `name[i]`) -> server name
        self._reported: set[str] = set()

    def __enter__(self) -> dict[str, ServerAddress]:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self, timeout_s: float | None = None) -> dict[str, ServerAddress]:
        """Start every server and wait until all answer /health; returns the registry. A failure stops
        whatever had started."""
        started = time.perf_counter()
        try:
            self._launch(self.start_timeout_s if timeout_s is None else timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - started
        return self.registry

    def _launch(self, timeout_s: float) -> None:
        raise NotImplementedError

    def stop(self, grace_s: float = 8.0) -> None:
        raise NotImplementedError

    def _exit_codes(self) -> dict[str, int]:
        """The replicas that have stopped, by process name, with their exit codes."""
        raise NotImplementedError

    def _kill_one(self, process_name: str) -> None:
        raise NotImplementedError

    def dead(self) -> tuple[str, int] | None:
        """(name, exit code) of a server all of whose replicas have stopped, if any.

        A replica that stops while others of its server live is reported (once) through `log`."""
        exited: dict[str, list[tuple[str, int]]] = {}
        for process_name, code in self._exit_codes().items():
            exited.setdefault(self._server_of[process_name], []).append((process_name, code))
        for name in self.config.servers:
            gone = exited.get(name, [])
            replicas = self.config.servers[name].replicas
            if gone and len(gone) == replicas:
                return name, gone[0][1]
            for process_name, code in gone:
                if process_name not in self._reported:
                    self._reported.add(process_name)
                    self.log(f"rollgym: replica '{process_name}' {self.exit_words(code)}; "
                             f"{replicas - len(gone)} of {replicas} replicas of '{name}' left")
        return None

    def exit_words(self, code: int) -> str:
        return f"exited with code {code}"

    def replicas(self, name: str) -> list[str]:
        """The process names of a server's replicas (`[name]` for a single one)."""
        return [process_name for process_name, server in self._server_of.items() if server == name]

    def kill(self, name: str) -> None:
        """Kill one replica (`name[i]`), or every replica of a server (used by fault tests)."""
        for process_name in [name] if name in self._server_of else self.replicas(name):
            self._kill_one(process_name)


async def wait_healthy(http: aiohttp.ClientSession, name: str, url: str, address: ServerAddress, deadline: float, *,
                       exited: Callable[[], int | None] = lambda: None, attempt_s: float = 1.0,
                       pause_s: float = 0.01) -> None:
    """Poll `url`/health until it answers 200; LaunchError when the process exits or the deadline passes."""
    headers = {"Authorization": f"Bearer {address.auth_token}"} if address.auth_token else {}
    while True:
        code = exited()
        if code is not None:
            raise LaunchError(f"server '{name}' exited with code {code} before it was ready (see its error above)")
        if time.monotonic() > deadline:
            raise LaunchError(f"server '{name}' did not answer /health at {url} in time")
        try:
            timeout = aiohttp.ClientTimeout(total=min(attempt_s, max(0.05, deadline - time.monotonic())))
            async with http.get(url + "/health", headers=headers, timeout=timeout) as reply:
                if reply.status == 200:
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        await asyncio.sleep(pause_s)
