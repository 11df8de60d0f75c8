"""Per-session workspaces on this machine: a directory that persists across a session's commands.

A workspace is a host directory (a size-limited tmpfs of its own when the server is root: the disk
limit) owned by one unprivileged uid leased for the session's whole life (RLIMIT_NPROC then counts
the session's processes, and no two sessions share a uid). Each command runs through the same
launcher as the `code` sandbox: in "namespaces" mode a fresh mount/PID/network/IPC/UTS namespace with
the read-only system, a private /tmp and the workspace mounted read-write at /workspace, nothing
else of the host; every process of the command dies with its PID namespace when the command ends, so
nothing is running between two commands and the server's own copies (snapshot, reset) never race one.

The server (root) never follows a path the sandbox user could have planted: file reads and writes
run inside the sandbox as the session's uid; snapshots and resets copy with `cp -a` (symbolic links
copied as links, special files as such) and delete with `shutil.rmtree` (which does not follow them).

`LocalWorkspaces` is blocking (call it from a thread); `rollgym.sandbox.provider` puts it behind the
asyncio interface that the Ray provider shares.
"""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import cgroups
from .cgroups import SessionGroup
from .isolation import Isolation, SandboxError, SandboxLimits, SandboxResult, UidLease, uid_processes_of
from .programs import detect_isolation, run_program

WORKDIR = "/workspace"  # where the workspace is mounted inside the sandbox ("namespaces" mode)
INPUT_DIR = "/run/sandbox"  # a command's input files ("namespaces" mode; $SANDBOX_INPUT says where, in every mode)
MNT_DETACH = 2


class WorkspaceError(SandboxError):
    """The workspace itself failed (cannot be made, copied or found): an infrastructure error."""


class FileAccessError(Exception):
    """A file operation the sandbox user was not allowed, or that found no file: the caller's fault."""


@dataclass(frozen=True)
class WorkspaceLimits:
    cpu_time_s: float = 60.0  # RLIMIT_CPU of each process of a command
    timeout_s: float = 60.0  # a command's default wall-clock limit (a call may ask for less or more, up to max)
    max_timeout_s: float = 600.0
    memory_mb: int = 2048  # RLIMIT_AS of each process
    max_processes: int = 64  # RLIMIT_NPROC of the session's uid (threads count)
    disk_mb: int = 256  # the workspace tmpfs (root only)
    disk_inodes: int = 65536
    tmp_mb: int = 64  # the private /tmp of each command
    file_size_mb: int = 64  # RLIMIT_FSIZE
    max_output_bytes: int = 64 * 1024  # kept per stream
    kill_output_bytes: int = 4 * 1024 * 1024  # more output and the command is killed
    session_memory_mb: int = 4096  # every process of the session together (its cgroup; where one can be made)
    session_cpu_s: float = 3600.0  # CPU seconds of the whole session, checked before each command (cgroup)

    def for_command(self, timeout_s: float | None) -> SandboxLimits:
        wall = min(self.max_timeout_s, timeout_s or self.timeout_s)
        return SandboxLimits(cpu_time_s=min(self.cpu_time_s, wall + 1), wall_time_s=wall, memory_mb=self.memory_mb,
                             max_output_bytes=self.max_output_bytes, kill_output_bytes=self.kill_output_bytes,
                             file_size_mb=self.file_size_mb, tmp_size_mb=self.tmp_mb,
                             max_processes=self.max_processes, max_open_files=1024)


@dataclass
class Workspace:
    id: str
    host_path: str  # the files (/workspace); beside it, the session's /tmp, both on the session's disk
    lease: UidLease | None
    mounted: bool
    template: str | None
    snapshots: dict[str, str]
    lock: threading.Lock
    group: SessionGroup | None = None
    hide: tuple[str, ...] = ()  # exposed folders its commands see empty (a copy of a task's solution)

    @property
    def uid(self) -> int | None:
        return self.lease.uid if self.lease else None

    @property
    def root(self) -> str:
        """The session's directory (its tmpfs): `files/` is the workspace, `tmp/` its /tmp."""
        return os.path.dirname(self.host_path)

    @property
    def tmp_path(self) -> str:
        return os.path.join(self.root, "tmp")


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


def _mount_tmpfs(path: str, limits: WorkspaceLimits, uid: int) -> bool:
    options = f"size={limits.disk_mb}m,nr_inodes={limits.disk_inodes},mode=0700,uid={uid},gid={uid}"
    return _libc.mount(b"tmpfs", path.encode(), b"tmpfs", 2 | 4, options.encode()) == 0  # nosuid, nodev


class LocalWorkspaces:
    """The workspaces of this machine, with a warm pool per template (blocking; thread-safe)."""

    def __init__(
        self,
        limits: WorkspaceLimits | None = None,
        *,
        isolation: str = "auto",
        toolchain: str | None = None,
        uid_base: int = 62000,
        uid_count: int = 512,
        pool_size: int = 0,
        root_dir: str | None = None,
    ) -> None:
        self.limits = limits or WorkspaceLimits()
        self._requested = isolation
        # The Python environment commands get on PATH (a venv or prefix, exposed read-only).
        self.toolchain = os.path.abspath(toolchain or sys.prefix)
        self.uid_base, self.uid_count = uid_base, uid_count
        self.pool_size = pool_size
        self.root_dir = root_dir or os.path.join(tempfile.gettempdir(), f"rollgym-workspaces-{os.geteuid()}")
        self._isolation: Isolation | None = None
        self._lock = threading.Lock()
        self._open: dict[str, Workspace] = {}
        self._pool: dict[str | None, deque[Workspace]] = {}
        self._refilling: set[str | None] = set()
        self._closed = False
        self._swept = False

    # --- set-up ----------------------------------------------------------------------------------
    @property
    def isolation(self) -> Isolation:
        with self._lock:
            if self._isolation is None:
                python = os.path.join(self.toolchain, "bin", "python3")
                self._isolation = detect_isolation(self._requested, python if os.path.exists(python) else None,
                                                   self.uid_base, uid_count=self.uid_count)
            return self._isolation

    def info(self) -> dict[str, Any]:
        isolation = self.isolation
        return {**isolation.describe(), "provider": "local", "toolchain": self.toolchain,
                "workdir": WORKDIR if isolation.mode == "namespaces" else "the workspace's host directory",
                "disk_limit": "tmpfs per workspace" if os.geteuid() == 0 else "not enforced (not root)",
                "session_cgroup": self._cgroup_kind(),
                "limits": self.limits.__dict__, "open": len(self._open),
                "pooled": {str(k): len(v) for k, v in self._pool.items()}}

    def _cgroup_kind(self) -> str:
        kinds = {w.group.kind for w in self._open.values() if w.group is not None}
        return ", ".join(sorted(kinds)) or "none seen yet (memory and CPU time are per process: rlimits)"

    def _sweep(self) -> None:
        """Remove what servers that died without closing their workspaces left (mounts, folders, groups)."""
        for entry in os.listdir(self.root_dir):
            owner = entry.split("-", 1)[0]
            if owner.isdigit() and int(owner) != os.getpid() and not os.path.exists(f"/proc/{owner}"):
                path = os.path.join(self.root_dir, entry)
                _libc.umount2(path.encode(), MNT_DETACH)
                shutil.rmtree(path, ignore_errors=True)
        cgroups.sweep(lambda owner: owner == os.getpid() or os.path.exists(f"/proc/{owner}"))

    def _make(self, template: str | None) -> Workspace:
        isolation = self.isolation
        os.makedirs(self.root_dir, mode=0o700, exist_ok=True)
        if not self._swept:
            self._swept = True
            self._sweep()
        lease = None
        if os.geteuid() == 0 and isolation.uid_base is not None:
            lease = UidLease.acquire(isolation.uid_base, isolation.uid_count, wait_s=30.0)
        ws_id = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"  # the owner's pid: a later server sweeps a dead one's
        path = os.path.join(self.root_dir, ws_id)
        os.mkdir(path, 0o700)
        mounted = lease is not None and _mount_tmpfs(path, self.limits, lease.uid)
        group = cgroups.make(ws_id, self.limits.session_memory_mb, self.limits.max_processes) if lease else None
        workspace = Workspace(ws_id, os.path.join(path, "files"), lease, mounted, template, {}, threading.Lock(), group)
        try:
            for directory in (workspace.host_path, workspace.tmp_path):
                os.mkdir(directory, 0o700)
                if lease is not None:
                    os.chown(directory, lease.uid, lease.uid)
            if lease is not None:
                os.chown(path, lease.uid, lease.uid)
            if template is not None:
                self._copy_in(template, workspace)
        except BaseException:
            self._destroy(workspace)
            raise
        return workspace

    def _copy_in(self, source: str, workspace: Workspace) -> None:
        """Copy a (trusted) directory's contents into the workspace, owned by the session's uid."""
        if not os.path.isdir(source):
            raise WorkspaceError(f"template {source!r} is not a directory")
        done = subprocess.run(["cp", "-a", "--no-preserve=ownership", f"{source}/.", workspace.host_path],
                              capture_output=True, text=True)
        if done.returncode != 0:
            raise WorkspaceError(f"copying {source} into the workspace failed: {done.stderr.strip()[-300:]}")
        os.chmod(workspace.host_path, 0o700)  # `cp -a src/.` gave it the template's mode
        if workspace.uid is not None:
            for directory, dirs, files in os.walk(workspace.host_path):
                for name in [*dirs, *files]:
                    os.lchown(os.path.join(directory, name), workspace.uid, workspace.uid)

    def _destroy(self, workspace: Workspace) -> None:
        if workspace.uid is not None and uid_processes_of(workspace.uid):
            self._kill_uid(workspace.uid)  # only in the weaker modes can a process outlive its command
        if workspace.group is not None:
            workspace.group.remove()
        if workspace.mounted:
            _libc.umount2(workspace.root.encode(), MNT_DETACH)
        shutil.rmtree(workspace.root, ignore_errors=True)
        for snapshot in workspace.snapshots.values():
            shutil.rmtree(snapshot, ignore_errors=True)
        if workspace.lease is not None:
            workspace.lease.release()

    @staticmethod
    def _kill_uid(uid: int) -> None:
        subprocess.run(["pkill", "-KILL", "-U", str(uid)], capture_output=True)

    # --- sessions --------------------------------------------------------------------------------
    def open(self, template: str | None = None, hide: tuple[str, ...] = ()) -> str:
        """A workspace holding a copy of `template` (a directory), from the warm pool when one is ready;
        its commands see the `hide` folders (of the system or the toolchain) empty."""
        template = os.path.abspath(template) if template else None
        with self._lock:
            queue = self._pool.get(template)
            workspace = queue.popleft() if queue else None
        if workspace is None:
            workspace = self._make(template)
        workspace.hide = tuple(hide)
        with self._lock:
            self._open[workspace.id] = workspace
        self._refill(template)
        return workspace.id

    def warm(self, template: str | None = None, count: int | None = None) -> None:
        """Fill the pool for `template` now (blocking) up to `count` (default: pool_size)."""
        template = os.path.abspath(template) if template else None
        want = self.pool_size if count is None else count
        while not self._closed:
            with self._lock:
                queue = self._pool.setdefault(template, deque())
                if len(queue) >= want:
                    return
            workspace = self._make(template)
            with self._lock:
                if not self._closed:  # a refill that ends after shutdown must not leave its workspace behind
                    self._pool.setdefault(template, deque()).append(workspace)
                    continue
            self._destroy(workspace)
            return

    def _refill(self, template: str | None) -> None:
        if self.pool_size <= 0:
            return
        with self._lock:
            if template in self._refilling:
                return
            self._refilling.add(template)

        def refill() -> None:
            try:
                self.warm(template)
            except Exception:  # noqa: BLE001 - a pool that cannot refill just makes the next open cold
                pass
            finally:
                with self._lock:
                    self._refilling.discard(template)

        threading.Thread(target=refill, name="workspace-pool", daemon=True).start()

    def _get(self, ws_id: str) -> Workspace:
        workspace = self._open.get(ws_id)
        if workspace is None:
            raise WorkspaceError(f"no open workspace {ws_id!r}")
        return workspace

    def close(self, ws_id: str) -> None:
        with self._lock:
            workspace = self._open.pop(ws_id, None)
        if workspace is not None:
            with workspace.lock:
                self._destroy(workspace)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            every = [*self._open.values(), *(w for queue in self._pool.values() for w in queue)]
            self._open.clear()
            self._pool.clear()
        for workspace in every:
            self._destroy(workspace)

    # --- commands --------------------------------------------------------------------------------
    def _run(self, workspace: Workspace, argv: list[str], timeout_s: float | None, stdin: bytes = b"",
             host_dir: str | None = None, output_bytes: int | None = None,
             read_only: tuple[tuple[str, str], ...] = ()) -> SandboxResult:
        isolation = self.isolation
        namespaced = isolation.mode == "namespaces"
        workdir = WORKDIR if namespaced else workspace.host_path
        # The session's /tmp, unless the toolchain lives under /tmp (it would be mounted inside what the session
        # owns): then each command gets a tmpfs of its own and $TMPDIR is its input folder.
        session_tmp = namespaced and not _under(self.toolchain, "/tmp")
        tmpdir = "/tmp" if session_tmp else INPUT_DIR if namespaced else workspace.tmp_path
        env = {"PATH": f"{self.toolchain}/bin:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": workdir,
               "TMPDIR": tmpdir, "PYTHONDONTWRITEBYTECODE": "1", "TERM": "dumb"}
        if namespaced and not session_tmp and not host_dir:
            host_dir = tempfile.mkdtemp(prefix=f"rollgym-ws-in-{os.getpid()}-")  # an empty input folder: the $TMPDIR
            try:
                return self._run(workspace, argv, timeout_s, stdin, host_dir, output_bytes, read_only)
            finally:
                shutil.rmtree(host_dir, ignore_errors=True)
        if host_dir:
            env["SANDBOX_INPUT"] = INPUT_DIR if namespaced else host_dir
        limits = self.limits.for_command(timeout_s)
        if output_bytes:
            limits = replace(limits, max_output_bytes=output_bytes, kill_output_bytes=max(output_bytes * 2, limits.kill_output_bytes))
        # Without namespaces there are no mounts: a read-only pair's host path is where the command finds it.
        binds = ((workspace.host_path, WORKDIR), *((host, inside, True) for host, inside in read_only)) if namespaced else ()
        return run_program(argv, isolation, limits, uid=workspace.uid, host_dir=host_dir,
                           workdir=workdir, env=env, binds=binds, tmp_bind=workspace.tmp_path if session_tmp else None,
                           input_dir=INPUT_DIR, expose=(self.toolchain,), hide=workspace.hide,
                           cgroups=tuple(workspace.group.procs) if workspace.group else (), stdin=stdin)

    def exec(self, ws_id: str, command: str, timeout_s: float | None = None, stdin: bytes = b"", *,
             files: dict[str, str | bytes] | None = None, read_only: tuple[tuple[str, str], ...] = (),
             output_bytes: int | None = None) -> SandboxResult:
        """Run `command` with bash in the workspace: exit status, stdout, stderr (bounded), why it was killed.

        `files` (name -> content) are put in a directory of this command's own, `$SANDBOX_INPUT`, that the
        workspace's other commands never see; `read_only` (host directory, path inside) pairs are shown
        read-only (at a path outside /tmp and /workspace, which the session owns; in the modes without
        namespaces, at their host path); `output_bytes` raises how much of each stream is kept.
        """
        workspace = self._get(ws_id)
        if "\0" in command:
            raise ValueError("a command cannot hold a NUL byte")
        with workspace.lock:
            if workspace.group is not None and workspace.group.cpu_s() >= self.limits.session_cpu_s:
                return SandboxResult(exit_code=None, stdout="", timed_out=False, killed_reason="session_cpu",
                                     stderr=f"this session has used its CPU time ({self.limits.session_cpu_s:g} s)",
                                     output_truncated=False, wall_s=0.0)
            if not files:
                return self._run(workspace, ["/bin/bash", "-c", command], timeout_s, stdin[:60_000],
                                 output_bytes=output_bytes, read_only=read_only)
            staging = self._stage(workspace, files)
            try:
                return self._run(workspace, ["/bin/bash", "-c", command], timeout_s, stdin[:60_000], host_dir=staging,
                                 output_bytes=output_bytes, read_only=read_only)
            finally:
                shutil.rmtree(staging, ignore_errors=True)

    def _stage(self, workspace: Workspace, files: dict[str, str | bytes]) -> str:
        """A fresh host directory holding a command's input files (the launcher copies them in)."""
        staging = tempfile.mkdtemp(prefix=f"rollgym-ws-in-{os.getpid()}-")
        for name, content in files.items():
            if "/" in name or name.startswith("."):
                shutil.rmtree(staging, ignore_errors=True)
                raise ValueError(f"bad input file name {name!r}")
            Path(staging, name).write_bytes(content.encode() if isinstance(content, str) else content)
            os.chmod(os.path.join(staging, name), 0o644)
        if workspace.uid is not None and self.isolation.mode != "namespaces":
            os.chown(staging, workspace.uid, workspace.uid)
            for name in files:
                os.chown(os.path.join(staging, name), workspace.uid, workspace.uid)
        return staging

    def read_file(self, ws_id: str, path: str, max_bytes: int = 1_000_000) -> str:
        """A text file of the workspace, read as the session's uid (a link out of it leads nowhere)."""
        workspace = self._get(ws_id)
        if "\0" in path:
            raise FileAccessError(f"{path!r}: a path cannot hold a NUL byte")
        quoted = shlex.quote(path)
        with workspace.lock:
            result = self._run(workspace, ["/bin/bash", "-c", f"test -f {quoted} || exit 3; head -c {max_bytes + 1} -- {quoted}"],
                               30, output_bytes=max_bytes + 1)
        if result.exit_code == 3:
            raise FileAccessError(f"{path}: no such file")
        if result.exit_code != 0:
            raise FileAccessError(f"{path}: {result.stderr.strip()[-300:] or f'exit status {result.exit_code}'}")
        if len(result.stdout.encode()) > max_bytes:
            raise FileAccessError(f"{path}: larger than {max_bytes} bytes")
        return result.stdout

    def write_file(self, ws_id: str, path: str, content: str) -> None:
        """Write a file of the workspace as the session's uid (parent directories made)."""
        workspace = self._get(ws_id)
        if "\0" in path:
            raise FileAccessError(f"{path!r}: a path cannot hold a NUL byte")
        staging = self._stage(workspace, {"content": content})
        try:
            quoted = shlex.quote(path)
            script = f"mkdir -p -- \"$(dirname -- {quoted})\" && cat -- \"$SANDBOX_INPUT/content\" > {quoted}"
            with workspace.lock:
                result = self._run(workspace, ["/bin/bash", "-c", script], 30, host_dir=staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if result.exit_code != 0:
            raise FileAccessError(f"{path}: {result.stderr.strip()[-300:] or f'exit status {result.exit_code}'}")

    # --- snapshots ---------------------------------------------------------------------------------
    def snapshot(self, ws_id: str, name: str = "default") -> None:
        """Keep a copy of the workspace as it is now (outside it: it does not count against its disk)."""
        workspace = self._get(ws_id)
        with workspace.lock:
            target = os.path.join(self.root_dir, f"{ws_id}.snap-{uuid.uuid4().hex[:8]}")
            done = subprocess.run(["cp", "-a", workspace.host_path, target], capture_output=True, text=True)
            if done.returncode != 0:
                shutil.rmtree(target, ignore_errors=True)
                raise WorkspaceError(f"snapshot failed: {done.stderr.strip()[-300:]}")
            old = workspace.snapshots.pop(name, None)
            workspace.snapshots[name] = target
        if old:
            shutil.rmtree(old, ignore_errors=True)

    def reset(self, ws_id: str, name: str | None = None) -> None:
        """Put the workspace back as snapshot `name` left it, or (no name) as its template was."""
        workspace = self._get(ws_id)
        with workspace.lock:
            source = workspace.snapshots.get(name) if name else workspace.template
            if name and source is None:
                raise WorkspaceError(f"no snapshot {name!r} of workspace {ws_id}")
            for entry in os.listdir(workspace.host_path):
                target = os.path.join(workspace.host_path, entry)
                if os.path.isdir(target) and not os.path.islink(target):
                    shutil.rmtree(target)
                else:
                    os.unlink(target)
            if source is not None:
                if name:
                    done = subprocess.run(["cp", "-a", f"{source}/.", workspace.host_path], capture_output=True, text=True)
                    if done.returncode != 0:
                        raise WorkspaceError(f"reset failed: {done.stderr.strip()[-300:]}")
                else:
                    self._copy_in(source, workspace)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def wait_for_no_processes(uid: int, deadline_s: float = 2.0) -> bool:
    """Whether the uid has no process left (polled until the deadline): for checks and benchmarks."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if not uid_processes_of(uid):
            return True
        time.sleep(0.01)
    return not uid_processes_of(uid)


