"""code: attacks on the sandbox, each through the server over real HTTP.

Each attack must be contained and reported, leave no process of the sandbox uids and no temporary
directory behind, and leave the server healthy (GET /health and a normal /verify still work).
Assertions that only the "namespaces" mode guarantees are made in that mode (the one a root CI
machine gets); the weaker modes' documented behaviour is checked otherwise.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
import random
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from resources_servers.code.app import CodeServer, CodeServerConfig
from rollgym.sandbox import Sandbox, SandboxError, SandboxLimits, UidLease, uid_processes_of
from rollgym.testing import final_response, serve_in_thread

FOLDER = Path(__file__).resolve().parents[1]
ROW = json.loads((FOLDER / "data" / "example.jsonl").read_text().splitlines()[0])  # add(a, b), 4 tests
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
UID_BASE = random.randrange(40000, 59000, 100)  # apart from other runs of these tests on the machine
CONCURRENT = 2
UID_COUNT = 8
WALL_S = 3.0
SECRET_NAME = "ROLLGYM_CODE_TEST_SECRET"
SECRET = f"secret-{uuid.uuid4().hex}"




def sandbox_processes() -> list[int]:
    return uid_processes_of(range(UID_BASE, UID_BASE + UID_COUNT))


def work_dirs() -> set[str]:
    """This process's sandbox directories (other test runs on the machine have their own)."""
    return set(glob.glob(os.path.join(tempfile.gettempdir(), f"rollgym-code-{os.getpid()}-*")))


class Env:
    def __init__(self, http: httpx.Client, mode: str) -> None:
        self.http = http
        self.mode = mode

    def run(self, code: str) -> str:
        answer = self.http.post("/run_python", json={"code": code})
        assert answer.status_code == 200, answer.text
        return answer.text

    def verify(self, answer: str) -> dict:
        reply = self.http.post("/verify", json={**ROW, "response": final_response(answer)})
        assert reply.status_code == 200, reply.text
        return reply.json()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[httpx.Client, str]]:
    os.environ[SECRET_NAME] = SECRET  # in the server's own environment (it runs in this process)
    config = CodeServerConfig(cpu_time_s=2.0, wall_time_s=WALL_S, test_timeout_s=0.5,
                              max_concurrent_sandboxes=CONCURRENT, sandbox_uid_base=UID_BASE,
                              sandbox_uid_count=UID_COUNT)
    try:
        with serve_in_thread(CodeServer(config, name="code")) as url, httpx.Client(base_url=url, timeout=60) as http:
            yield http, http.get("/sandbox_info").json()["mode"]
    finally:
        os.environ.pop(SECRET_NAME, None)


@pytest.fixture
def env(server: tuple[httpx.Client, str]) -> Iterator[Env]:
    """The server; after the attack: no sandbox process or directory left, and the server still works."""
    http, mode = server
    before = work_dirs()
    yield Env(http, mode)
    assert sandbox_processes() == [], "a sandbox process survived its run"
    assert work_dirs() - before == set(), "a sandbox directory was left behind"
    assert http.get("/health").status_code == 200
    assert Env(http, mode).verify(GOOD)["reward"] == 1.0


def test_infinite_loop_is_stopped(env: Env) -> None:
    started = time.monotonic()
    text = env.run("while True:\n    pass\n")
    assert time.monotonic() - started < WALL_S + 3
    first = text.splitlines()[0]
    assert first.startswith("killed: ") and ("CPU-time" in first or "wall-time" in first), text
    verdict = env.verify("```python\nwhile True:\n    pass\n```")  # a module-level loop: the alarm, then CPU
    # killed at load by its CPU limit ("crashed"), or stopped by the load's own timer: the answer's failure either way
    assert verdict["reward"] == 0.0 and verdict["reason"] in ("candidate_error", "crashed", "killed", "timeout")
    assert verdict["test_results"] == [False] * 4


def test_sleeping_forever_hits_the_wall_limit(env: Env) -> None:
    started = time.monotonic()
    verdict = env.verify("```python\nimport time\ndef add(a, b):\n    return a + b\nimport signal\n"
                         "signal.signal(signal.SIGALRM, signal.SIG_IGN)\ntime.sleep(3600)\n```")
    assert time.monotonic() - started < WALL_S + 3
    assert verdict["reward"] == 0.0 and verdict["reason"] == "timeout" and verdict["exit_code"] is None


@pytest.mark.parametrize(
    "bomb",
    [
        "import os\nwhile True:\n    os.fork()\n",
        # A bomb whose processes survive failed forks, so it runs until the wall limit kills it all.
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
    ],
    ids=["plain", "persistent"],
)
def test_fork_bomb_is_contained(env: Env, bomb: str) -> None:
    started = time.monotonic()
    text = env.run(bomb)
    assert time.monotonic() - started < WALL_S + 5
    first = text.splitlines()[0]
    assert first.startswith(("exit status", "killed:")), text
    if "try" in bomb:
        assert first.startswith("killed:")
    else:
        assert "BlockingIOError" in text  # the process limit stopped it


def test_huge_allocation_fails(env: Env) -> None:
    text = env.run("x = bytearray(10**10)\nprint('allocated')\n")
    assert "MemoryError" in text and "allocated" not in text.split("--- stderr ---")[0]
    verdict = env.verify("```python\ndef add(a, b):\n    if a == 2:\n        x = bytearray(10**10)\n    return a + b\n```")
    assert verdict["test_results"] == [False, True, True, True] and verdict["reward"] == 0.75
    assert verdict["first_failure"]["error"].startswith("MemoryError")


def test_no_connection_to_the_host(env: Env) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept())
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        server_port = int(env.http.base_url.port)
        text = env.run(
            "import socket\n"
            f"for port in ({port}, {server_port}):\n"
            "    try:\n"
            "        s = socket.create_connection(('127.0.0.1', port), timeout=1)\n"
            "        print('CONNECTED', port)\n"
            "    except OSError as exc:\n"
            "        print('BLOCKED', port, type(exc).__name__, exc)\n"
        )
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
    assert "CONNECTED" not in text and text.count("BLOCKED") == 2, text
    assert accepted == []
    if env.mode == "namespaces":
        assert "Network is unreachable" in text  # a private network namespace: its loopback is down


def test_host_files_and_environment_are_out_of_reach(env: Env) -> None:
    host_passwd = Path("/etc/passwd").read_text().splitlines()
    code = (
        "import os\n"
        "print('ENV', dict(os.environ))\n"
        f"for path in ('/etc/passwd', '/proc/1/environ', '/proc/{os.getpid()}/environ', '/proc/self/environ',\n"
        f"             '{FOLDER / 'app.py'}', '/root/.bash_history'):\n"
        "    try:\n"
        "        print('READ', path, open(path, 'rb').read()[:4000])\n"
        "    except OSError as exc:\n"
        "        print('DENIED', path, type(exc).__name__)\n"
    )
    text = env.run(code)
    assert SECRET not in text, "the server's environment leaked"
    assert f"DENIED /proc/{os.getpid()}/environ" in text
    assert "DENIED /root/.bash_history" in text
    if env.mode == "namespaces":
        # A generated /etc/passwd (root and the sandbox user), not the host's; no project files.
        extra = [line for line in host_passwd if not line.startswith("root:")]
        assert extra and not any(line.split(":")[0] + ":x:" in text for line in extra)
        assert "READ /etc/passwd" in text and "sandbox:x:" in text
        assert f"DENIED {FOLDER / 'app.py'}" in text
        assert "DENIED /proc/1/environ" in text  # init runs as root
        assert "ENV {'PATH'" in text and "'HOME': '/tmp/sandbox'" in text
    else:
        pytest.skip(f"mode {env.mode}: world-readable host files (/etc/passwd) are readable; documented")


def test_no_writes_outside_the_work_directory(env: Env) -> None:
    name = f"escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", str(FOLDER / name), f"/var/tmp/{name}", f"/dev/shm/{name}", f"/{name}"]
    code = (
        "import os\n"
        "open('inside.txt', 'w').write('ok')\n"
        "print('INSIDE', open('inside.txt').read())\n"
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('escaped')\n"
        "        print('WROTE', path)\n"
        "    except OSError as exc:\n"
        "        print('DENIED', path, type(exc).__name__)\n"
    )
    try:
        text = env.run(code)
        assert "INSIDE ok" in text
        assert f"DENIED {FOLDER / name}" in text and f"DENIED /{name}" in text
        for target in targets[1:]:
            assert not os.path.exists(target), f"{target} was written on the host"
        if env.mode == "namespaces":
            assert f"DENIED /tmp/{name}" in text and f"DENIED /var/tmp/{name}" in text
            assert not os.path.exists(f"/tmp/{name}")
            # /dev/shm is a private tmpfs that dies with the sandbox: writable, but not the host's.
        else:
            pytest.skip(f"mode {env.mode}: world-writable host directories (/tmp) are writable; documented")
    finally:
        for target in targets:
            if os.path.exists(target):
                os.unlink(target)


def test_output_flood_is_capped_and_killed(env: Env) -> None:
    started = time.monotonic()
    reply = env.http.post("/run_python", json={"code": "print('x' * 100_000_000)"})
    assert time.monotonic() - started < WALL_S + 3
    text = reply.text
    assert text.splitlines()[0].startswith("killed: output limit")
    assert "[output truncated" in text and len(text) < 20_000  # what the model sees is small
    # Through /verify: the answer's own stdout and stderr go to /dev/null (the grader's report is another
    # process's), so a flood on either is dropped and reaches nothing.
    verdict = env.verify("```python\nimport sys\ndef add(a, b):\n    return a + b\nsys.stderr.write('y' * 10**8)\n```")
    assert verdict["reward"] == 1.0, verdict
    verdict = env.verify("```python\ndef add(a, b):\n    return a + b\nprint('z' * 10**8)\n```")
    assert verdict["reward"] == 1.0


def test_the_sandbox_result_fields() -> None:
    box = Sandbox(SandboxLimits(wall_time_s=WALL_S, max_output_bytes=1024), max_concurrent=1,
                  uid_base=UID_BASE, uid_count=UID_COUNT)
    try:
        result = asyncio.run(box.run_code("import sys\nprint('a' * 5000)\nprint('err', file=sys.stderr)\nsys.exit(4)"))
    finally:
        box.close()
    assert result.exit_code == 4 and result.stdout == "a" * 1024 and result.stderr == "err\n"
    assert result.output_truncated and not result.timed_out and result.killed_reason is None
    assert 0 < result.wall_s < WALL_S


def test_a_uid_is_held_by_one_run_at_a_time() -> None:
    # The lease is an flock: it excludes other threads, worker processes and servers alike.
    first = UidLease.acquire(UID_BASE, 2)
    second = UidLease.acquire(UID_BASE, 2)
    try:
        assert {first.uid, second.uid} == {UID_BASE, UID_BASE + 1}
        with pytest.raises(SandboxError, match="stayed busy"):
            UidLease.acquire(UID_BASE, 2, wait_s=0.1)
        first.release()
        third = UidLease.acquire(UID_BASE, 2, wait_s=1.0)
        assert third.uid == first.uid
        third.release()
    finally:
        first.release()
        second.release()


@pytest.mark.skipif(os.geteuid() != 0, reason="the basic mode needs root")
def test_basic_mode_fallback() -> None:
    """Without namespaces (e.g. a container without CAP_SYS_ADMIN): uid, rlimits and the socket guard."""
    box = Sandbox(SandboxLimits(wall_time_s=WALL_S, cpu_time_s=2.0), max_concurrent=1, isolation="basic",
                  uid_base=UID_BASE, uid_count=UID_COUNT)
    try:
        info = box.info()
        assert info["mode"] == "basic"
        code = (
            "import os, socket\nprint('UID', os.getuid())\n"
            "try:\n    socket.create_connection(('127.0.0.1', 9), timeout=1)\nexcept OSError as exc:\n    print('BLOCKED', exc)\n"
            "if os.fork() == 0:\n    os.setsid()\n    import time\n    time.sleep(60)\n"
        )
        result = asyncio.run(box.run_code(code))
        uid = int(result.stdout.split("UID ")[1].split()[0])
        assert UID_BASE <= uid < UID_BASE + UID_COUNT and "BLOCKED" in result.stdout
        assert sandbox_processes() == []  # the setsid'd child was killed with the rest of the uid
        bomb = asyncio.run(box.run_code("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"))
        assert bomb.timed_out and sandbox_processes() == []
    finally:
        box.close()
