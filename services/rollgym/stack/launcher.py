"""Starts every server of a stack as its own process, waits for health, and stops them all.

The launcher binds each server's listening socket itself (a free loopback port unless the config
names one) and passes it to the child, so the whole registry is known before any child starts and
no two servers race for a port. Children die with the launcher (PR_SET_PDEATHSIG on Linux).

To start in about the time of one Python import instead of one per server, the launcher imports
the server code once and forks each child from itself. Forking is only safe from a process with a
single thread, so with other threads running (inside a test runner, say) children are spawned as
fresh interpreters instead; so are they from a process that has imported torch (a trainer that starts
its rollouts' stack): once it has asked for the GPU (`torch.cuda.is_available()` is enough), a forked
child can no longer use CUDA, and a model server on the GPU fails its start.

A server with `replicas: N` gets N children, each on its own socket (ports `port`..`port+N-1` when
the config names a port); its registry entry lists the N URLs. The children are named `name[i]`.
The stack counts as dead when every replica of some server has exited; a replica that exits while
others of its server live is reported once.

`Stack(config, registry=...)` starts only the servers of `config` but gives them a registry that
also names servers running elsewhere (`rollgym serve-one`, in a container).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import aiohttp
import orjson

from ..client import ServerAddress
from ..config import StackConfig
from ..errors import LaunchError
from ..processes import die_with_parent
from .backend import StackBackend, wait_healthy


def _in_child() -> None:
    # Runs in each server child right after fork (before exec for a spawned one). A server stops on
    # SIGINT and SIGTERM: neither the launcher's handlers (KeyboardInterrupt) nor a SIGINT ignored by
    # whoever started the launcher (a background job of a script) may carry over. SIGTERM from the
    # kernel if the launcher dies.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(signal.SIGTERM)


def replica_name(name: str, index: int, replicas: int) -> str:
    """The process name of one replica: the server's name for a single replica, else `name[i]`."""
    return name if replicas == 1 else f"{name}[{index}]"


class Stack(StackBackend):
    """A running stack: `with Stack(config) as registry: ...` or `start()` / `stop()`."""

    def __init__(
        self,
        config: StackConfig,
        *,
        python: str | None = None,
        fork: bool = True,
        registry: Mapping[str, ServerAddress] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(config, log=log)
        self.python = python or sys.executable
        self.fork = fork and python is None
        # Servers this stack does not start but its servers may call (e.g. other containers).
        self.external_registry: dict[str, ServerAddress] = dict(registry or {})
        # One entry per replica: the server's name, or `name[i]` for a server with several replicas.
        self.processes: dict[str, subprocess.Popen | ForkedServer] = {}
        self._sockets: dict[str, socket.socket] = {}
        self._replica_of: dict[str, tuple[str, int]] = {}  # process name -> (server name, index)
        self._replica_urls: dict[str, str] = {}
        self._state_dir: tempfile.TemporaryDirectory | None = None

    def _launch(self, timeout_s: float) -> None:
        """Bind every replica's socket, fork (or spawn) its child, and wait until all answer /health."""
        self._bind_sockets()
        stack_file, stack = self._write_stack_file()
        use_fork = (self.fork and hasattr(os, "fork") and threading.active_count() == 1
                    and "torch" not in sys.modules)
        if use_fork:
            from . import serve

            serve.preload(stack)
        for process_name, sock in self._sockets.items():
            name, index = self._replica_of[process_name]
            fd = sock.fileno()
            if use_fork:
                self.processes[process_name] = ForkedServer(
                    stack, name, sock, list(self._sockets.values()), replica=index
                )
            else:
                self.processes[process_name] = subprocess.Popen(
                    [self.python, "-m", "rollgym.stack.serve", stack_file, name, "--fd", str(fd), "--replica", str(index)],
                    pass_fds=(fd,),
                    preexec_fn=_in_child if os.name == "posix" else None,
                )
        for sock in self._sockets.values():
            sock.close()  # the children hold their copies
        asyncio.run(self._wait_healthy(timeout_s))

    def _bind_sockets(self) -> None:
        for name, spec in self.config.servers.items():
            host = str(spec.options.get("host", "127.0.0.1"))
            base_port = int(spec.options.get("port", 0))
            urls = []
            for index in range(spec.replicas):
                port = base_port + index if base_port else 0
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                process_name = replica_name(name, index, spec.replicas)
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    sock.close()
                    raise LaunchError(f"server '{process_name}' cannot listen on {host}:{port}: {exc.strerror}") from None
                sock.listen(4096)
                sock.set_inheritable(True)
                self._sockets[process_name] = sock
                self._replica_of[process_name] = (name, index)
                self._server_of[process_name] = name
                reach = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
                if ":" in reach:
                    reach = f"[{reach}]"
                urls.append(f"http://{reach}:{sock.getsockname()[1]}")
                self._replica_urls[process_name] = urls[-1]
            self.registry[name] = ServerAddress.replicated(
                urls, role=spec.role, auth_token=spec.options.get("auth_token"),
                shared_sessions=spec.replicas > 1 and spec.options.get("session_store") == "sqlite",
            )

    def _write_stack_file(self) -> tuple[str, dict[str, Any]]:
        self._state_dir = tempfile.TemporaryDirectory(prefix="rollgym-stack-")
        path = Path(self._state_dir.name) / "stack.json"
        # Servers of this stack are reached as bound here; others as the given registry says.
        registry = {**self.external_registry, **self.registry}
        payload = {
            "servers": self.config.to_json(),
            "registry": {name: address.to_json() for name, address in registry.items()},
            # One random secret per stack signs every server's session cookies.
            "secret": secrets.token_hex(32),
        }
        path.touch(0o600)
        path.write_bytes(orjson.dumps(payload))
        return str(path), payload

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self._wait_one(http, name, deadline) for name in self.processes))

    async def _wait_one(self, http: aiohttp.ClientSession, name: str, deadline: float) -> None:
        await wait_healthy(http, name, self._replica_urls[name], self.registry[self._replica_of[name][0]], deadline,
                           exited=self.processes[name].poll)

    def _exit_codes(self) -> dict[str, int]:
        return {name: code for name, process in self.processes.items() if (code := process.poll()) is not None}

    def replica_url(self, process_name: str) -> str:
        """The URL one replica listens on."""
        return self._replica_urls[process_name]

    def stop(self, grace_s: float = 8.0) -> None:
        """Stop every child: SIGTERM, then SIGKILL after `grace_s`."""
        for process in self.processes.values():
            if process.poll() is None:
                try:
                    process.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for sock in self._sockets.values():
            sock.close()
        if self._state_dir is not None:
            self._state_dir.cleanup()
            self._state_dir = None

    def _kill_one(self, process_name: str) -> None:
        self.processes[process_name].kill()
        self.processes[process_name].wait()


class ForkedServer:
    """A server child forked from the launcher, with the part of Popen's interface the Stack uses."""

    def __init__(
        self, stack: dict[str, Any], name: str, sock: socket.socket, all_sockets: list[socket.socket], replica: int = 0
    ) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: serve, never return into the launcher's code
            code = 1
            try:
                _in_child()
                for other in all_sockets:
                    if other is not sock:
                        other.close()
                from .serve import run_server

                code = run_server(stack, name, sock.fileno(), replica)
            except BaseException as exc:  # noqa: BLE001 - report anything, then leave
                print(f"rollgym: server '{name}' crashed: {type(exc).__name__}: {exc}", file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"server pid {self.pid}", timeout or 0)
            time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
