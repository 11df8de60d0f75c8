"""Running one sandboxed program: `run_sandbox` (blocking) and `Sandbox` (asyncio, bounded).

No HTTP here. `run_sandbox` runs `python3 -I -S -B script` over a few files in a fresh directory
(removed afterwards); `run_program` is the core under it and under the workspaces (any argv, a
working directory, read-write binds): it starts `launcher.py` with a JSON config, reads the
program's output with caps, enforces a backstop deadline and collects the launcher's status lines.
`Sandbox` wraps `run_sandbox` for asyncio: the run goes to a thread and an `asyncio.Semaphore`
bounds how many run at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import os
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .isolation import (
    DEFAULT_EXPOSE, GUARD_NAME, LAUNCHER, MODES, PATH, SANDBOX_DIR_IN_NAMESPACE, SCRIPT_NAME, SOCKET_GUARD,
    Isolation, SandboxError, SandboxLimits, SandboxResult, UidLease, default_python, interpreter_paths,
    user_thread_count, world_executable,
)

# --- one run ------------------------------------------------------------------------------------
def _program_env(workdir: str) -> dict[str, str]:
    return {"PATH": PATH, "LANG": "C.UTF-8", "HOME": workdir, "TMPDIR": workdir}


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def run_sandbox(
    files: dict[str, str | bytes],
    isolation: Isolation,
    limits: SandboxLimits,
    *,
    script: str = SCRIPT_NAME,
    stdin: bytes = b"",
    uid_wait_s: float = 120.0,
) -> SandboxResult:
    """Run `python3 -I -S -B script` over `files` (name -> content) in a fresh directory. Blocking.

    Whatever the program does, this returns a SandboxResult; it raises SandboxError only when the
    sandbox could not be set up (a broken machine or configuration, never the program's fault).
    """
    if len(stdin) > 32 * 1024:
        raise ValueError("stdin is limited to 32 KiB")
    root = os.geteuid() == 0
    lease = None
    uid = None
    if root and isolation.uid_base is not None and isolation.mode != "minimal":
        lease = UidLease.acquire(isolation.uid_base, isolation.uid_count, uid_wait_s)
        uid = lease.uid
    try:
        return _run_in_dir(files, isolation, limits, script, stdin, uid, root)
    finally:
        if lease is not None:
            lease.release()  # only now: every process of the run is gone


def _run_in_dir(files: dict[str, str | bytes], isolation: Isolation, limits: SandboxLimits, script: str,
                stdin: bytes, uid: int | None, root: bool) -> SandboxResult:
    host_dir = tempfile.mkdtemp(prefix=f"rollgym-code-{os.getpid()}-")
    try:
        for name, content in files.items():
            if "/" in name or name.startswith("."):
                raise ValueError(f"bad file name {name!r}")
            Path(host_dir, name).write_bytes(content.encode() if isinstance(content, str) else content)
        argv = [isolation.python, "-I", "-S", "-B", script]
        if isolation.mode != "namespaces":
            Path(host_dir, GUARD_NAME).write_text(SOCKET_GUARD)
            argv = [isolation.python, "-I", "-S", "-B", GUARD_NAME, script]
        if uid is not None:
            for path in [host_dir, *(os.path.join(host_dir, n) for n in os.listdir(host_dir))]:
                os.chown(path, uid, uid)
        os.chmod(host_dir, 0o700)
        return run_program(argv, isolation, limits, uid=uid, host_dir=host_dir, stdin=stdin)
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)


def run_program(
    argv: list[str],
    isolation: Isolation,
    limits: SandboxLimits,
    *,
    uid: int | None,
    host_dir: str | None = None,
    workdir: str | None = None,
    env: dict[str, str] | None = None,
    binds: tuple[tuple[str, str] | tuple[str, str, bool], ...] = (),
    expose: tuple[str, ...] = (),
    cgroups: tuple[str, ...] = (),
    stdin: bytes = b"",
    tmp_bind: str | None = None,
    input_dir: str | None = None,
    hide: tuple[str, ...] = (),
) -> SandboxResult:
    """Run `argv` confined as `isolation` says, as `uid`. Blocking; raises SandboxError only when the
    sandbox could not be set up.

    `host_dir`'s files are copied into `input_dir` (default /tmp/sandbox, the work directory) in
    "namespaces" mode, and are the work directory itself in the others. `binds` are (host path, path
    inside[, read-only]) mounted read-write unless the third field is true (a workspace); `tmp_bind`
    is a host directory mounted as /tmp (a session's own) instead of a tmpfs per run; `expose` adds
    read-only paths to the isolation's; `hide` are exposed folders shown empty ("namespaces" mode). `workdir` is where
    the program starts (inside the namespace in "namespaces" mode). `cgroups` are `cgroup.procs` files the
    launcher joins before it forks (a workspace session's groups).
    """
    root = os.geteuid() == 0
    namespaced = isolation.mode == "namespaces"
    workdir = workdir or (SANDBOX_DIR_IN_NAMESPACE if namespaced else host_dir or "/")
    fds: dict[str, int] = {}  # the status pipe; each end closed exactly once (fd numbers are reused)
    try:
        fds["r"], fds["w"] = os.pipe()
        config = {
            "mode": isolation.mode,
            "argv": argv,
            "env": env if env is not None else _program_env(workdir),
            "host_dir": host_dir,
            "workdir": workdir,
            "binds": [list(bound) for bound in binds],
            "tmp_bind": tmp_bind if namespaced else None,
            "input_dir": input_dir,
            "hide": list(hide),
            "cgroups": list(cgroups),
            "uid": uid,
            "gid": uid,
            "user_name": "sandbox",
            "limits": {
                "cpu_s": max(1, int(-(-limits.cpu_time_s // 1))),
                "as_bytes": limits.memory_mb * 1024 * 1024,
                "fsize_bytes": limits.file_size_mb * 1024 * 1024,
                "nofile": limits.max_open_files,
                "nproc": limits.max_processes if uid is not None or not root else None,
            },
            "wall_s": limits.wall_time_s,
            "status_fd": fds["w"],
            "expose": list(dict.fromkeys([*isolation.expose, *expose])) if namespaced else [],
            "tmpfs_bytes": limits.tmp_size_mb * 1024 * 1024,
            "tmpfs_inodes": 4096,
            "shm_bytes": 16 * 1024 * 1024,
        }
        if not root:  # RLIMIT_NPROC counts every thread of the user: leave room for those already running
            config["limits"]["nproc"] = user_thread_count(os.getuid()) + limits.max_processes
        return _supervise(config, isolation, limits, stdin, fds)
    finally:
        for fd in fds.values():
            os.close(fd)


def _supervise(config: dict[str, Any], isolation: Isolation, limits: SandboxLimits, stdin: bytes,
               fds: dict[str, int]) -> SandboxResult:
    """Start the launcher, read its output with caps, enforce the backstop deadline, collect the status."""
    started = time.monotonic()
    process = subprocess.Popen(
        [isolation.python, "-I", "-S", "-B", str(LAUNCHER), json.dumps(config)],
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=(fds["w"],),
        close_fds=True,
        start_new_session=True,  # the launcher leads its own process group: the backstop kills it whole
        env={"PATH": PATH, "LANG": "C.UTF-8"},
        cwd="/",
    )
    os.close(fds.pop("w"))  # only the launcher writes status now
    if stdin:
        try:
            process.stdin.write(stdin)  # small (checked): fits in the pipe buffer, never blocks
        except (BrokenPipeError, OSError):
            pass
        finally:
            try:
                process.stdin.close()
            except OSError:
                pass
    captured = {"stdout": bytearray(), "stderr": bytearray()}
    truncated = False
    total = 0
    output_killed = False
    backstop = started + limits.wall_time_s + 10.0  # the launcher enforces wall_time_s itself
    exited_at: float | None = None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "stdout")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    try:
        while selector.get_map():
            now = time.monotonic()
            if process.poll() is not None and exited_at is None:
                exited_at = now
            # After the launcher exits, every process of the sandbox is gone (or, in "minimal" mode,
            # only escaped ones hold the pipes): stop reading shortly after.
            if now > backstop or (exited_at is not None and now > exited_at + 1.0):
                break
            for key, _ in selector.select(timeout=0.05):
                chunk = os.read(key.fileobj.fileno(), 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                total += len(chunk)
                buffer = captured[key.data]
                room = limits.max_output_bytes - len(buffer)
                if len(chunk) > room:
                    truncated = True
                if room > 0:
                    buffer += chunk[:room]
                if total > limits.kill_output_bytes and not output_killed:
                    output_killed = True
                    _terminate(process)
    finally:
        selector.close()
    if process.poll() is None:  # past the backstop: the launcher is stuck; kill it and its group
        _kill_group(process)  # (init is in the group; its death takes the namespace with it)
    process.wait()
    for stream in (process.stdout, process.stderr):
        stream.close()
    wall = time.monotonic() - started
    events = _read_status(fds["r"])
    errors = [e["error"] for e in events if "error" in e]
    if errors:
        raise SandboxError(errors[0])
    done = next((e for e in events if e.get("done")), None)
    exit_line = next((e for e in events if "exit_code" in e), None)
    killed = done.get("killed") if done else "timeout"  # no "done": the backstop killed the launcher
    exit_code: int | None = None
    if exit_line is not None:
        exit_code = exit_line["exit_code"] if exit_line["signal"] is None else -exit_line["signal"]
    elif done is None or killed is None:
        if process.returncode not in (0, None):
            raise SandboxError(f"the sandbox launcher exited with {process.returncode} without a status")
    reason: str | None = None
    if output_killed:
        reason = "output_limit"
    elif killed == "timeout":
        reason = "timeout"
    elif killed and killed != "terminated":
        reason = killed
    elif exit_line is not None and exit_line["signal"] is not None:
        number = exit_line["signal"]
        reason = "cpu_time" if number == signal.SIGXCPU else f"signal {_signal_name(number)}"
    return SandboxResult(
        exit_code=exit_code,
        stdout=captured["stdout"].decode("utf-8", "replace"),
        stderr=captured["stderr"].decode("utf-8", "replace"),
        timed_out=reason == "timeout",
        killed_reason=reason,
        output_truncated=truncated,
        wall_s=round(done.get("wall_s", wall) if done else wall, 4),
    )


def _terminate(process: subprocess.Popen) -> None:
    """Ask the launcher to kill the program now (it kills init, or the uid's processes, then reports)."""
    try:
        process.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_status(fd: int) -> list[dict[str, Any]]:
    os.set_blocking(fd, False)
    data = bytearray()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            time.sleep(0.01)  # a writer (a dying init) may still hold it for an instant
            continue
        if not chunk:
            break
        data += chunk
    events = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events


# --- choosing the mode --------------------------------------------------------------------------
PROBE = "import os, sys\nprint('ok', os.getuid())\n"


def detect_isolation(
    requested: str = "auto",
    python: str | None = None,
    uid_base: int = 60000,
    expose: tuple[str, ...] = DEFAULT_EXPOSE,
    uid_count: int = 64,
) -> Isolation:
    """The strongest mode that works here (or the requested one, checked): runs a probe program."""
    python = os.path.realpath(python or default_python())
    if requested not in ("auto", *MODES):
        raise SandboxError(f"unknown isolation mode {requested!r}")
    root = os.geteuid() == 0
    candidates = list(MODES) if requested == "auto" else [requested]
    if root:  # "minimal" would run the programs as root
        if requested == "minimal":
            raise SandboxError("isolation 'minimal' would run programs as root: use 'basic' or 'namespaces'")
        candidates = [mode for mode in candidates if mode != "minimal"]
    else:
        if requested in ("namespaces", "basic"):
            raise SandboxError(f"isolation {requested!r} needs the server to run as root")
        candidates = ["minimal"]
    notes: list[str] = []
    for mode in candidates:
        mode_python = python
        if root and mode == "basic" and not world_executable(python):
            # The unprivileged uid must reach the interpreter itself (a pyenv under /root is not).
            fallback = shutil.which("python3", path=PATH)
            if fallback and world_executable(os.path.realpath(fallback)):
                notes.append(f"basic: {python} is not reachable by other users; using {fallback}")
                mode_python = os.path.realpath(fallback)
        paths = interpreter_paths(mode_python) if mode == "namespaces" else ()
        isolation = Isolation(
            mode=mode, python=mode_python,
            expose=tuple(dict.fromkeys([*expose, *paths])) if mode == "namespaces" else (),
            uid_base=uid_base if root and mode != "minimal" else None, uid_count=uid_count,
        )
        try:
            result = run_sandbox({SCRIPT_NAME: PROBE}, isolation, SandboxLimits(wall_time_s=20.0, cpu_time_s=10.0))
        except SandboxError as exc:
            notes.append(f"{mode}: {exc}")
            continue
        if result.exit_code == 0 and result.stdout.startswith("ok"):
            return Isolation(**{**asdict(isolation), "expose": isolation.expose, "notes": tuple(notes)})
        notes.append(f"{mode}: probe failed (exit {result.exit_code}): {result.stderr.strip()[-300:]}")
    raise SandboxError("no sandbox mode works here: " + "; ".join(notes))


# --- asyncio front ------------------------------------------------------------------------------
class Sandbox:
    """Runs programs off the event loop, at most `max_concurrent` at once (each with its own uid)."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        max_concurrent: int = 4,
        isolation: str = "auto",
        python: str | None = None,
        uid_base: int = 60000,
        uid_count: int = 64,
        expose: tuple[str, ...] = DEFAULT_EXPOSE,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.max_concurrent = max_concurrent
        self._requested = isolation
        self._python = python
        self._uid_base = uid_base
        self._uid_count = uid_count
        self._expose = tuple(expose)
        self._isolation: Isolation | None = None
        self._detect_lock = threading.Lock()
        self._semaphores: dict[int, asyncio.Semaphore] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_concurrent, thread_name_prefix="sandbox")

    @property
    def isolation(self) -> Isolation:
        """The mode in force (detected on first use; blocking: call it off the event loop)."""
        with self._detect_lock:
            if self._isolation is None:
                self._isolation = detect_isolation(self._requested, self._python, self._uid_base, self._expose,
                                                   self._uid_count)
            return self._isolation

    async def prepare(self) -> Isolation:
        return self._isolation or await asyncio.to_thread(lambda: self.isolation)

    def info(self) -> dict[str, Any]:
        return {**self.isolation.describe(), "limits": asdict(self.limits), "max_concurrent": self.max_concurrent}

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        semaphore = self._semaphores.get(id(loop))
        if semaphore is None:
            semaphore = self._semaphores[id(loop)] = asyncio.Semaphore(self.max_concurrent)
        return semaphore

    async def run(
        self,
        files: dict[str, str | bytes],
        *,
        script: str = SCRIPT_NAME,
        stdin: bytes = b"",
        limits: SandboxLimits | None = None,
    ) -> SandboxResult:
        """Run `script` over `files` in a sandbox; waits for a free one (at most `max_concurrent` run)."""
        isolation = await self.prepare()
        loop = asyncio.get_running_loop()
        semaphore = self._semaphore()
        await semaphore.acquire()
        call = functools.partial(run_sandbox, files, isolation, limits or self.limits, script=script, stdin=stdin)
        try:
            future = loop.run_in_executor(self._pool, call)
        except BaseException:
            semaphore.release()
            raise
        # Released when the run is really over, even if the caller was cancelled meanwhile.
        future.add_done_callback(lambda _: semaphore.release())
        return await asyncio.shield(future)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run_code(self, code: str, **kwargs: Any) -> SandboxResult:
        """Run one Python source as the program's main script."""
        return await self.run({SCRIPT_NAME: code}, **kwargs)
