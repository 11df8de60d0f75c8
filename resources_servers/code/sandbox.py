"""A sandbox for untrusted Python: `python3 -I -S -B` under rlimits, an unprivileged uid and namespaces.

No HTTP here. `run_sandbox` is the blocking core (one program, one fresh temporary directory, removed
afterwards); `Sandbox` wraps it for asyncio: the run goes to a thread and an `asyncio.Semaphore`
bounds how many run at once. Each run holds its own uid out of `uid_base .. uid_base+uid_count-1`
for its whole life (an flock on a per-uid lock file, so the allocation holds across threads, worker
processes and servers on one machine): the per-uid process limit and the kill-everything-of-this-uid
cleanup of one run never touch another.

The confinement itself is done by `launcher.py` (started here with a JSON config), in one of three
modes, the strongest the machine allows unless the config asks for one:

- "namespaces": root with CAP_SYS_ADMIN. New mount, network, PID, IPC and UTS namespaces; a new
  root built from read-only binds (system directories + the interpreter), generated /etc, minimal
  /dev, this namespace's /proc, and a private size-limited /tmp; an unprivileged uid; no_new_privs.
- "basic": root, but namespaces refused (e.g. a container without CAP_SYS_ADMIN). Unprivileged uid
  and rlimits in the host's filesystem and network; sockets blocked by a Python-level guard only.
- "minimal": not root. rlimits and the Python-level socket guard only, as the server's own user.

See README.md ("Sandbox") for exactly what each mode contains and what it does not.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import fcntl
import functools
import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

LAUNCHER = Path(__file__).resolve().with_name("launcher.py")
MODES = ("namespaces", "basic", "minimal")
# What the program can see in "namespaces" mode, besides the interpreter's own directories.
DEFAULT_EXPOSE = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SANDBOX_DIR_IN_NAMESPACE = "/tmp/sandbox"
SCRIPT_NAME = "main.py"
GUARD_NAME = "_sandbox_guard.py"
PATH = "/usr/local/bin:/usr/bin:/bin"

# Prepended (as a separate wrapper script) in the modes without a network namespace. Weak on purpose
# and documented as such: `_socket`, ctypes or a subprocess get around it.
SOCKET_GUARD = '''\
import runpy, socket, sys
_BLOCKED = {getattr(socket, name) for name in ("AF_INET", "AF_INET6", "AF_PACKET") if hasattr(socket, name)}
class _GuardedSocket(socket.socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None and (family == -1 or family in _BLOCKED):
            raise PermissionError(13, "network access is disabled in this sandbox")
        super().__init__(family, type, proto, fileno)
socket.socket = socket.SocketType = _GuardedSocket
def _no_connection(*args, **kwargs):
    raise PermissionError(13, "network access is disabled in this sandbox")
socket.create_connection = socket.create_server = socket.getaddrinfo = _no_connection
del _no_connection
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


class SandboxError(Exception):
    """The sandbox itself failed (not the program in it): an infrastructure error."""


@dataclass(frozen=True)
class SandboxLimits:
    cpu_time_s: float = 5.0
    wall_time_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 64 * 1024  # kept per stream (stdout, stderr)
    kill_output_bytes: int = 1024 * 1024  # stdout + stderr beyond this: the program is killed
    file_size_mb: int = 16  # RLIMIT_FSIZE: the largest file the program may write
    tmp_size_mb: int = 64  # the private /tmp (work directory included), "namespaces" mode
    max_processes: int = 32  # RLIMIT_NPROC of the sandbox uid (threads count)
    max_open_files: int = 256


@dataclass
class SandboxResult:
    exit_code: int | None  # the program's exit status; -N when a signal N ended it; None if unknown
    stdout: str
    stderr: str
    timed_out: bool
    killed_reason: str | None  # "timeout", "cpu_time", "output_limit", "signal SIGSEGV", ...
    output_truncated: bool
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Isolation:
    """How programs are confined on this machine (the outcome of `detect_isolation`)."""

    mode: str
    python: str
    expose: tuple[str, ...] = ()
    uid_base: int | None = None
    uid_count: int = 64
    notes: tuple[str, ...] = field(default_factory=tuple)

    def describe(self) -> dict[str, Any]:
        network = {
            "namespaces": "private network namespace (loopback only, down): no connection can be made",
            "basic": "host network; Python-level socket guard only (bypassable)",
            "minimal": "host network; Python-level socket guard only (bypassable)",
        }[self.mode]
        filesystem = {
            "namespaces": f"private root: {', '.join(self.expose)} read-only, generated /etc, minimal /dev, "
                          f"own /proc, private /tmp; work directory {SANDBOX_DIR_IN_NAMESPACE}",
            "basic": "host filesystem as an unprivileged uid (world-readable files are readable, "
                     "world-writable directories such as /tmp are writable)",
            "minimal": "host filesystem as the server's own user",
        }[self.mode]
        return {
            "mode": self.mode,
            "python": self.python,
            "uid_base": self.uid_base,
            "uid_count": self.uid_count if self.uid_base is not None else None,
            "network": network,
            "filesystem": filesystem,
            "processes": "own PID namespace, all killed when the program exits" if self.mode == "namespaces"
            else "every process of the sandbox uid killed when the program exits" if self.mode == "basic"
            else "the program's process group killed when it exits",
            "notes": list(self.notes),
        }


# --- the interpreter ----------------------------------------------------------------------------
def default_python() -> str:
    """The real interpreter behind the server's (a venv's python is a symlink to it)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


def interpreter_paths(python: str) -> tuple[str, ...]:
    """The directories the interpreter needs (its prefixes and its own directory)."""
    probe = subprocess.run(
        [python, "-I", "-S", "-c", "import json, sys; print(json.dumps([sys.base_prefix, sys.base_exec_prefix]))"],
        capture_output=True, text=True, timeout=30, env={"PATH": PATH}, stdin=subprocess.DEVNULL,
    )
    if probe.returncode != 0:
        raise SandboxError(f"the sandbox interpreter {python!r} does not run: {probe.stderr.strip()[-500:]}")
    prefixes = json.loads(probe.stdout)
    return tuple(dict.fromkeys(os.path.realpath(p) for p in [*prefixes, os.path.dirname(python)]))


def world_executable(path: str) -> bool:
    """Whether any user may run `path`: the file is o+x and every directory above it o+x."""
    try:
        if not os.stat(path).st_mode & 0o001:
            return False
        parent = os.path.dirname(os.path.abspath(path))
        while True:
            if not os.stat(parent).st_mode & 0o001:
                return False
            if parent == "/":
                return True
            parent = os.path.dirname(parent)
    except OSError:
        return False


# --- uids ---------------------------------------------------------------------------------------
def lock_dir() -> str:
    """Where the per-uid lock files live: a directory only this (root) user may write."""
    path = os.path.join(tempfile.gettempdir(), f"rollgym-sandbox-uids-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SandboxError(f"{path} is not a private directory of this user: remove it")
    return path


class UidLease:
    """One sandbox uid, held (flock on its lock file) until released or until this process dies."""

    def __init__(self, uid: int, fd: int) -> None:
        self.uid = uid
        self._fd = fd

    @classmethod
    def acquire(cls, base: int, count: int, wait_s: float = 120.0) -> "UidLease":
        directory = lock_dir()
        deadline = time.monotonic() + wait_s
        start = random.randrange(count)  # spread concurrent runs over the range
        while True:
            for offset in range(count):
                uid = base + (start + offset) % count
                fd = os.open(os.path.join(directory, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue
                return cls(uid, fd)
            if time.monotonic() > deadline:
                raise SandboxError(f"all {count} sandbox uids from {base} stayed busy for {wait_s:g} s")
            time.sleep(0.02)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1


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
    fds: dict[str, int] = {}  # the status pipe; each end closed exactly once (fd numbers are reused)
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
        workdir = SANDBOX_DIR_IN_NAMESPACE if isolation.mode == "namespaces" else host_dir
        fds["r"], fds["w"] = os.pipe()
        config = {
            "mode": isolation.mode,
            "argv": argv,
            "env": _program_env(workdir),
            "host_dir": host_dir,
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
            "expose": list(isolation.expose),
            "tmpfs_bytes": limits.tmp_size_mb * 1024 * 1024,
            "tmpfs_inodes": 4096,
            "shm_bytes": 16 * 1024 * 1024,
        }
        if not root:  # RLIMIT_NPROC counts every thread of the user: leave room for those already running
            config["limits"]["nproc"] = _user_thread_count(os.getuid()) + limits.max_processes
        return _supervise(config, isolation, limits, stdin, fds)
    finally:
        for fd in fds.values():
            os.close(fd)
        shutil.rmtree(host_dir, ignore_errors=True)


def uid_processes_of(uid: int | range | list[int]) -> list[int]:
    """PIDs of the host's processes (zombies included) whose real uid is `uid`, or one of them."""
    wanted = {uid} if isinstance(uid, int) else set(uid)
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                for line in handle:
                    if line.startswith("Uid:"):
                        if int(line.split()[1]) in wanted:
                            pids.append(int(entry))
                        break
        except (OSError, ValueError):
            continue
    return pids


def _user_thread_count(uid: int) -> int:
    """Threads of the processes of `uid`: what RLIMIT_NPROC counts."""
    count = 0
    for pid in uid_processes_of(uid):
        try:
            with open(f"/proc/{pid}/status") as handle:
                count += next((int(line.split()[1]) for line in handle if line.startswith("Threads:")), 1)
        except (OSError, ValueError):
            continue
    return count


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
