"""Workspaces (rollgym.sandbox): a directory that persists across a session's commands, each command a
fresh sandbox over it; limits per session, snapshot/reset, a warm pool, and the provider interface.
Real namespaces, uids and tmpfs mounts where the machine allows them (as root here)."""

from __future__ import annotations

import asyncio
import os
import random
import sysconfig
import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from rollgym.sandbox import FileAccessError, LocalProvider, LocalWorkspaces, WorkspaceLimits, uid_processes_of

UID_BASE = random.randrange(20000, 39000, 100)  # apart from other runs of these tests on the machine
LIMITS = WorkspaceLimits(timeout_s=10, cpu_time_s=10, disk_mb=8, max_processes=24, max_output_bytes=4096,
                         kill_output_bytes=64 * 1024)
# Forks sleeping children until the session's process limit refuses one.
FORKS = """import os, time
started = 0
for _ in range(60):
    try:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        started += 1
    except OSError as exc:
        print("refused", exc.strerror)
        break
print(started)"""


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("template")
    (folder / "pkg").mkdir()
    (folder / "pkg" / "mod.py").write_text("def answer():\n    return 41\n")
    (folder / "README").write_text("a repository\n")
    return str(folder)


@pytest.fixture(scope="module")
def workspaces() -> Iterator[LocalWorkspaces]:
    spaces = LocalWorkspaces(LIMITS, uid_base=UID_BASE, uid_count=16, pool_size=1)
    yield spaces
    spaces.shutdown()


def test_a_workspace_persists_across_commands_and_resets(workspaces: LocalWorkspaces, template: str) -> None:
    ws = workspaces.open(template)
    try:
        assert workspaces.exec(ws, "cat pkg/mod.py").stdout == "def answer():\n    return 41\n"
        workspaces.exec(ws, "sed -i s/41/42/ pkg/mod.py && echo note > notes.txt")
        ran = workspaces.exec(ws, "python -c 'import pkg.mod; print(pkg.mod.answer())'; cat notes.txt")
        assert ran.stdout == "42\nnote\n" and ran.exit_code == 0
        workspaces.snapshot(ws, "edited")
        workspaces.exec(ws, "rm -rf pkg notes.txt")
        workspaces.write_file(ws, "new/deep/file.txt", "x = 1\n")
        assert workspaces.read_file(ws, "new/deep/file.txt") == "x = 1\n"
        workspaces.reset(ws, "edited")
        assert workspaces.exec(ws, "ls; cat pkg/mod.py | grep -c 42").stdout == "README\nnotes.txt\npkg\n1\n"
        workspaces.reset(ws)  # as the template was
        assert workspaces.exec(ws, "ls; grep -c 41 pkg/mod.py").stdout == "README\npkg\n1\n"
        with pytest.raises(FileAccessError, match="no such file"):
            workspaces.read_file(ws, "missing.txt")
    finally:
        workspaces.close(ws)


def test_the_warm_pool_hands_out_a_ready_workspace_fast(workspaces: LocalWorkspaces, template: str) -> None:
    workspaces.warm(template, 1)
    started = time.monotonic()
    ws = workspaces.open(template)
    took = time.monotonic() - started
    try:
        assert took < 0.05, took
        assert workspaces.exec(ws, "ls").stdout == "README\npkg\n"
    finally:
        workspaces.close(ws)


def test_commands_are_confined(workspaces: LocalWorkspaces, tmp_path: Path) -> None:
    if workspaces.isolation.mode != "namespaces":
        pytest.skip("needs the namespaces mode (root with CAP_SYS_ADMIN)")
    secret = tmp_path / f"secret-{uuid.uuid4().hex}"
    secret.write_text("host secret")
    os.chmod(secret, 0o644)
    a, b = workspaces.open(), workspaces.open()
    try:
        workspaces.exec(b, "echo b-private > mine.txt")
        ran = workspaces.exec(a, f"cat {secret}; ls {tmp_path}; touch /usr/escape; echo x > /etc/escape; "
                                 f"python -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), 2)'; "
                                 f"ls /; id -u")
        out = ran.stdout + ran.stderr
        assert "host secret" not in out and "No such file or directory" in out
        assert "Read-only file system" in out and "Network is unreachable" in out
        assert ran.stdout.strip().splitlines()[-1] == str(workspaces._open[a].uid)
        assert not os.path.exists("/usr/escape")
        # the other session's files exist on the host but not in this session's view
        seen = workspaces.exec(a, "cat mine.txt; ls -A / /tmp /workspace")
        assert "mine.txt" not in seen.stdout and "No such file" in seen.stderr
        assert workspaces.exec(b, "cat mine.txt").stdout == "b-private\n"
        # a planted link cannot make the server write outside: the write runs as the session's uid
        workspaces.exec(a, "ln -s /etc/passwd link")
        with pytest.raises(FileAccessError):
            workspaces.write_file(a, "link", "root::0:0::/:/bin/sh\n")
    finally:
        workspaces.close(a)
        workspaces.close(b)


def test_limits_hold_per_session(workspaces: LocalWorkspaces) -> None:
    if workspaces.isolation.mode != "namespaces":
        pytest.skip("needs the namespaces mode (root with CAP_SYS_ADMIN)")
    ws = workspaces.open()
    uid = workspaces._open[ws].uid
    try:
        full = workspaces.exec(ws, "head -c 20000000 /dev/zero > big; echo $?; du -sm big | cut -f1")
        assert "No space left on device" in full.stderr and int(full.stdout.split()[-1]) <= 8
        bomb = workspaces.exec(ws, f"python -c '{FORKS}'", timeout_s=5)
        assert "refused" in bomb.stdout and int(bomb.stdout.split()[-1]) < 24 and bomb.killed_reason is None, bomb
        assert uid_processes_of(uid) == []  # the sleepers died with the command's PID namespace
        slow = workspaces.exec(ws, "sleep 30", timeout_s=1)
        assert slow.killed_reason == "timeout" and slow.wall_s < 5
        flood = workspaces.exec(ws, "yes")
        assert flood.killed_reason == "output_limit" and len(flood.stdout) == 4096 and flood.output_truncated
        assert workspaces.exec(ws, "rm big; echo ok").stdout == "ok\n"  # the session goes on
    finally:
        workspaces.close(ws)
    assert not os.path.exists(workspaces.root_dir + "/" + ws)


def test_the_local_provider_serves_concurrent_sessions(template: str) -> None:
    provider = LocalProvider(LIMITS, max_concurrent=4, uid_base=UID_BASE + 20, uid_count=8)

    async def session(n: int) -> str:
        ws = await provider.open(template)
        try:
            await provider.exec(ws, f"echo {n} > n.txt")
            return (await provider.exec(ws, "cat n.txt; ls")).stdout
        finally:
            await provider.close(ws)

    async def main() -> list[str]:
        assert (await provider.prepare())["provider"] == "local"
        return await asyncio.gather(*(session(n) for n in range(6)))

    try:
        assert asyncio.run(main()) == [f"{n}\nREADME\nn.txt\npkg\n" for n in range(6)]
    finally:
        provider.shutdown()


def test_memory_and_cpu_time_are_bounded_for_the_whole_session() -> None:
    spaces = LocalWorkspaces(WorkspaceLimits(session_memory_mb=160, session_cpu_s=1.0, memory_mb=2048, timeout_s=20),
                             uid_base=UID_BASE + 40, uid_count=2)
    ws = spaces.open()
    try:
        if spaces._open[ws].group is None:
            pytest.skip("no control group can be made here: memory and CPU time are bounded per process only")
        two = "python -c 'a = bytearray(100 * 2**20); b = bytearray(100 * 2**20); print(\"both\")'; echo status $?"
        assert spaces.exec(ws, two).stdout.endswith("status 137\n")  # 200 MB in one session: killed
        assert spaces.exec(ws, "python -c 'a = bytearray(100 * 2**20); print(\"one\")'").stdout == "one\n"
        spin = "python -c 'import time\nwhile time.process_time() < 1.2: pass'"  # 1.2 CPU seconds, however loaded
        assert spaces.exec(ws, spin).exit_code == 0
        spent = spaces.exec(ws, "echo more")
        assert spent.killed_reason == "session_cpu" and "used its CPU time" in spent.stderr
    finally:
        spaces.close(ws)
        spaces.shutdown()


def test_what_a_dead_server_left_is_swept(tmp_path: Path) -> None:
    """A server killed without closing its workspaces leaves mounts, folders and groups; the next one
    on the machine removes those whose owner process is gone."""
    import subprocess

    dead = subprocess.Popen(["true"])
    dead.wait()
    spaces = LocalWorkspaces(LIMITS, uid_base=UID_BASE + 50, uid_count=2, root_dir=str(tmp_path / "ws"))
    leftover = tmp_path / "ws" / f"{dead.pid}-0123456789ab"
    leftover.mkdir(parents=True)
    (leftover / "file").write_text("x")
    group = Path("/sys/fs/cgroup/pids/rollgym") / leftover.name
    try:
        group.mkdir(parents=True)
    except OSError:
        group = None  # no control groups here: the folder is still swept
    ws = spaces.open()
    try:
        assert not leftover.exists() and (group is None or not group.exists())
        assert (tmp_path / "ws" / ws).is_dir() and ws.startswith(f"{os.getpid()}-")
    finally:
        spaces.shutdown()
    assert not (tmp_path / "ws" / ws).exists()


def test_a_path_exposed_below_tmp_is_seen_read_only_beside_the_private_tmp(tmp_path: Path) -> None:
    """A checkout or venv that lives under /tmp (pytest's tmp_path does) is exposed inside the sandbox
    although the sandbox gets a /tmp of its own."""
    from rollgym.sandbox import SandboxLimits, detect_isolation, run_program

    isolation = detect_isolation("auto", uid_base=UID_BASE + 40, uid_count=4)
    if isolation.mode != "namespaces":
        pytest.skip("needs the namespaces mode (root with CAP_SYS_ADMIN)")
    assert str(tmp_path).startswith("/tmp/")
    (tmp_path / "tool.txt").write_text("exposed\n")
    os.chmod(tmp_path, 0o755)
    result = run_program(["/bin/sh", "-c", f"cat {tmp_path}/tool.txt; touch {tmp_path}/x; ls /tmp"],
                         isolation, SandboxLimits(), uid=UID_BASE + 41, expose=(str(tmp_path),))
    assert result.stdout.splitlines()[0] == "exposed"
    assert "Read-only file system" in result.stderr and not (tmp_path / "x").exists()
    assert "sandbox" in result.stdout.split()  # the private /tmp holds the work directory


def test_a_session_has_its_own_tmp_inputs_and_read_only_views(workspaces: LocalWorkspaces, template: str,
                                                              tmp_path: Path) -> None:
    if workspaces.isolation.mode != "namespaces":
        pytest.skip("needs the namespaces mode (root with CAP_SYS_ADMIN)")
    shown = tmp_path / "shown"
    (shown / "pkg").mkdir(parents=True)
    (shown / "pkg" / "answer.py").write_text("ANSWER = 42\n")
    os.chmod(tmp_path, 0o755)
    hidden = os.path.join(sysconfig.get_paths()["purelib"], "_pytest")  # a folder of the toolchain (sys.prefix)
    hidden_file = os.path.join(sysconfig.get_paths()["purelib"], "py.py")  # a module alone among others: only it
    ws = workspaces.open(template, hide=(hidden, hidden_file))
    try:
        made = workspaces.exec(ws, "t=$(mktemp) && echo kept > $t && echo $t; echo $TMPDIR; cat /proc/1/cmdline; "
                                   "ls /proc | grep -c '^[0-9]'")
        path, tmpdir, count = made.stdout.split("\n")[:3]
        assert path.startswith("/tmp/tmp.") and tmpdir == "/tmp" and "No such file" in made.stderr and int(count) <= 3
        assert workspaces.exec(ws, f"cat {path}").stdout == "kept\n"  # the session's /tmp persists
        assert "tmp" not in workspaces.exec(ws, "ls -A").stdout.split()  # and is not in the workspace
        # the disk limit counts /tmp and the workspace together
        assert "No space left" in workspaces.exec(ws, "head -c 6M /dev/zero > /tmp/a; head -c 6M /dev/zero > b").stderr
        ran = workspaces.exec(ws, f'cat "$SANDBOX_INPUT/note"; ls /run/shown; touch /run/shown/x; ls -A {hidden} | wc -l; '
                                  f'wc -c < {hidden_file}; ls {os.path.dirname(hidden_file)} | grep -cx py.py',
                              files={"note": "private\n"}, read_only=((str(shown), "/run/shown"),))
        assert ran.stdout.split("\n")[:5] == ["private", "pkg", "0", "0", "1"] and "Read-only file system" in ran.stderr
        assert os.path.getsize(hidden_file) > 0
        assert os.listdir(hidden)  # shown empty inside only
        assert workspaces.exec(ws, 'echo ${SANDBOX_INPUT:-none}').stdout.strip() == "none"  # inputs are per command
        with pytest.raises(FileAccessError, match="NUL"):
            workspaces.read_file(ws, "a\0b")
        with pytest.raises(ValueError, match="NUL"):
            workspaces.exec(ws, "echo a\0b")
    finally:
        workspaces.close(ws)
