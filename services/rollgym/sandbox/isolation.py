"""How sandboxed programs are confined: the modes, the limits, the interpreter, the uids.

The confinement itself is done by `launcher.py` (started by `programs.py` with a JSON config), in
one of three modes, the strongest the machine allows unless the config asks for one:

- "namespaces": root with CAP_SYS_ADMIN. New mount, network, PID, IPC and UTS namespaces; a new
  root built from read-only binds (system directories + the interpreter), generated /etc, minimal
  /dev, this namespace's /proc, and a private size-limited /tmp; an unprivileged uid; no_new_privs.
- "basic": root, but namespaces refused (e.g. a container without CAP_SYS_ADMIN). Unprivileged uid
  and rlimits in the host's filesystem and network; sockets blocked by a Python-level guard only.
- "minimal": not root. rlimits and the Python-level socket guard only, as the server's own user.

Each run (or workspace session) holds its own uid out of `uid_base .. uid_base+uid_count-1` for its
whole life (an flock on a per-uid lock file, so the allocation holds across threads, worker processes
and servers on one machine): the per-uid process limit and the kill-everything-of-this-uid cleanup of
one never touch another. docs/sandbox.md says exactly what each mode contains and what it does not.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
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


def user_thread_count(uid: int) -> int:
    """Threads of the processes of `uid`: what RLIMIT_NPROC counts."""
    count = 0
    for pid in uid_processes_of(uid):
        try:
            with open(f"/proc/{pid}/status") as handle:
                count += next((int(line.split()[1]) for line in handle if line.startswith("Threads:")), 1)
        except (OSError, ValueError):
            continue
    return count


