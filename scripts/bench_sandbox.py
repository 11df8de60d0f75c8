"""Workspace sandboxes: start time (cold, warm pool), command latency, memory per sandbox, many
concurrent sessions, the escape table (each attempt made through the swe server's `bash` tool over
HTTP: it must fail, come back as the tool's output, and leave the server healthy), and the swe
server's `/verify` (the gold patch through the editor, submitted, graded; one at a time).

    python scripts/bench_sandbox.py [--sessions 64] [--opens 20] [--verifies 10] [--only verify]

`--only verify` times `/verify` alone, over HTTP only, so the same script measures an older checkout
(PYTHONPATH pointing at it) against this one.

Prints figures as it goes. Needs root (namespaces, tmpfs, uids) for the figures that mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "services")]

from resources_servers.swe.app import SweServer, SweServerConfig  # noqa: E402
from resources_servers.swe.gold import editor_calls  # noqa: E402
from resources_servers.swe.repos import build  # noqa: E402
from rollgym.sandbox import LocalWorkspaces, WorkspaceLimits, uid_processes_of  # noqa: E402
from rollgym.testing import final_response, serve_in_thread  # noqa: E402

ROW = json.loads((REPO / "resources_servers/swe/data/example.jsonl").read_text().splitlines()[0])


def ms(values: list[float]) -> str:
    values = sorted(values)
    p95 = values[min(len(values) - 1, int(0.95 * len(values)))]
    return f"mean {1000 * statistics.mean(values):.1f} ms, p50 {1000 * values[len(values) // 2]:.1f} ms, p95 {1000 * p95:.1f} ms"


def pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def bench_start(template: str, opens: int, uid_base: int) -> None:
    spaces = LocalWorkspaces(WorkspaceLimits(), uid_base=uid_base, uid_count=opens + 8, pool_size=0)
    print(f"isolation: {spaces.isolation.mode}")
    cold, first_command, commands = [], [], []
    for _ in range(opens):
        started = time.monotonic()
        ws = spaces.open(template)
        cold.append(time.monotonic() - started)
        spaces.exec(ws, "true")
        first_command.append(time.monotonic() - started)
        for _ in range(3):
            t = time.monotonic()
            spaces.exec(ws, "true")
            commands.append(time.monotonic() - t)
        spaces.close(ws)
    print(f"cold open (tmpfs + uid + copy of a {du(template)} repository), {opens}x: {ms(cold)}")
    print(f"cold open + first command: {ms(first_command)}")
    print(f"a command (`true`) in an open workspace: {ms(commands)}")
    spaces.pool_size = opens
    spaces.warm(template, opens)
    warm = []
    for _ in range(opens):
        started = time.monotonic()
        ws = spaces.open(template)
        warm.append(time.monotonic() - started)
        spaces.close(ws)
    print(f"warm-pool open: {ms(warm)}")
    spaces.shutdown()


def du(path: str) -> str:
    total = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return f"{total / 1024:.0f} KiB"


def bench_concurrent(template: str, sessions: int, uid_base: int) -> None:
    spaces = LocalWorkspaces(WorkspaceLimits(), uid_base=uid_base, uid_count=sessions + 8, pool_size=0)
    spaces.isolation
    latencies: list[float] = []
    errors: list[str] = []
    memory: list[int] = []
    barrier = threading.Barrier(sessions)

    def session(n: int) -> None:
        try:
            ws = spaces.open(template)
            try:
                barrier.wait(timeout=120)
                for command in ("ls -R | wc -l", "python -c 'import json; print(json.dumps([1]))'",
                                f"echo {n} > mine.txt && cat mine.txt", "sleep 2"):
                    started = time.monotonic()
                    result = spaces.exec(ws, command, timeout_s=120)
                    latencies.append(time.monotonic() - started)
                    if result.exit_code != 0:
                        errors.append(f"{command}: {result.exit_code} {result.stderr[-200:]}")
            finally:
                spaces.close(ws)
        except Exception as exc:  # noqa: BLE001 - counted, reported
            errors.append(f"{type(exc).__name__}: {exc}")

    def sample() -> None:
        while not done.is_set():
            memory.append(pss_kib(descendants(os.getpid())))
            time.sleep(0.2)

    done = threading.Event()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.monotonic()
    with ThreadPoolExecutor(sessions) as pool:
        list(pool.map(session, range(sessions)))
    wall = time.monotonic() - started
    done.set()
    sampler.join()
    peak = max(memory) if memory else 0
    print(f"{sessions} concurrent sessions on {os.cpu_count()} cores (4 commands each, the last `sleep 2`): "
          f"{wall:.1f} s wall, {len(errors)} errors; per command {ms(latencies)}")
    print(f"memory of the sandboxes' processes at the peak (PSS of launchers, inits, commands): {peak / 1024:.0f} MiB, "
          f"{peak / max(1, sessions):.0f} KiB per running sandbox (+ its workspace's files in tmpfs)")
    for error in errors[:5]:
        print("  error:", error)
    spaces.shutdown()


ESCAPES = [
    ("network: connect out", "python -c \"import socket; socket.create_connection(('1.1.1.1', 80), 3)\"",
     lambda out, ctx: "Network is unreachable" in out),
    ("network: the server's own port", "python -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 3)\"",
     lambda out, ctx: "refused" in out or "unreachable" in out),
    ("read host files outside the workspace", "cat /etc/shadow {repo}/README.md; ls /root /work 2>&1 | head -3",
     lambda out, ctx: "No such file" in out and "rollgym" not in out),
    ("write outside the workspace", "touch /usr/evil /etc/evil /evil; echo x > /tmp/evil-{tag} && ls /tmp",
     lambda out, ctx: "Read-only file system" in out and not os.path.exists(f"/tmp/evil-{ctx['tag']}")),
    ("fork bomb", "bomb() {{ bomb | bomb & }}; bomb; sleep 3; echo still here",
     lambda out, ctx: not uid_processes_of(ctx["uid_range"])),
    ("fill the disk", "head -c 4G /dev/zero > big; ls -la big | cut -c1-60; rm -f big",
     lambda out, ctx: "No space left on device" in out),
    ("memory bomb", "python -c \"x = bytearray(16 * 1024**3)\"",
     lambda out, ctx: "MemoryError" in out),
    ("a process left after the session", "nohup sleep 1000 >/dev/null 2>&1 & setsid sleep 1000 & echo started",
     lambda out, ctx: not uid_processes_of(ctx["uid_range"])),
    ("the launcher's configuration in /proc", "cat /proc/1/cmdline; ls /proc | grep -c '^[0-9]'; cat /proc/*/cmdline | tr '\\0' ' '",
     lambda out, ctx: "No such file" in out and "launcher" not in out and "workspaces" not in out),
    ("read another session's workspace", "cat {other}/secret.txt; ls /workspace/..; find / -name secret.txt 2>/dev/null | head -3",
     lambda out, ctx: "the-other-secret" not in out),
]


def escape_table(repos: Path, uid_base: int) -> None:
    config = SweServerConfig(repos_dir=str(repos), pool_size=0, sandbox_uid_base=uid_base, sandbox_uid_count=16,
                             command_timeout_s=10, disk_mb=64, memory_mb=1024, max_processes=32)
    server = SweServer(config, name="swe")
    ctx = {"tag": f"{random.randrange(10**9)}", "uid_range": range(uid_base, uid_base + 16), "repo": str(REPO)}
    with serve_in_thread(server) as url:
        ctx["port"] = url.rsplit(":", 1)[1]
        other = httpx.Client(base_url=url, timeout=120)
        other.post("/seed_session", json=ROW)
        other.post("/bash", json={"command": "echo the-other-secret > secret.txt"})
        other_ws = [w for w in server.provider.workspaces._open.values()][0]
        ctx["other"] = other_ws.host_path
        print("\n| attempt | contained | the tool's output (last 120 chars) | server healthy |")
        print("|---|---|---|---|")
        for name, command, check in ESCAPES:
            with httpx.Client(base_url=url, timeout=120) as http:
                http.post("/seed_session", json=ROW)
                reply = http.post("/bash", json={"command": command.format(**ctx)})
                output = reply.text
                http.post("/verify", json={**ROW, "response": final_response("done")})
            time.sleep(0.2)
            contained = reply.status_code == 200 and check(output, ctx)
            healthy = httpx.get(f"{url}/health", timeout=10).status_code == 200
            shown = " ".join(output.split())[-120:].replace("|", "\\|")
            print(f"| {name} | {'yes' if contained else 'NO'} | {shown} | {'yes' if healthy else 'NO'} |")
        other.close()


def bench_verify(repos: Path, count: int, uid_base: int, submit: bool = True) -> None:
    """`/verify` of the gold patch, one rollout at a time (after one warm-up): the grader's whole cost (without
    `submit`, the patch is taken from the workspace inside /verify)."""
    config = SweServerConfig(repos_dir=str(repos), pool_size=2, sandbox_uid_base=uid_base, sandbox_uid_count=16)
    walls, tests, cpus = [], [], []
    with serve_in_thread(SweServer(config, name="swe")) as url:
        for n in range(count + 1):
            with httpx.Client(base_url=url, timeout=300) as http:
                http.post("/seed_session", json=ROW)
                for call in editor_calls(ROW["patch"]):
                    http.post("/str_replace_editor", json=call)
                if submit:
                    http.post("/submit", json={})
                time.sleep(0.5)  # the warm pool's refill (a copy of the repository) is not the verify's
                started, cpu = time.monotonic(), cpu_s()
                answer = http.post("/verify", json={**ROW, "response": final_response("done")}).json()
                if n:  # the first one builds the template
                    walls.append(time.monotonic() - started)
                    cpus.append(cpu_s() - cpu)
                    tests.append(answer.get("test_wall_s") or 0.0)
                assert answer["reward"] == 1.0, answer
    print(f"/verify of the gold patch ({'submitted' if submit else 'not submitted'}), {count}x one at a time: "
          f"{ms(walls)}; of which the test command "
          f"{ms(tests)}; CPU (server and every sandbox process) {ms(cpus)}")


def cpu_s() -> float:
    """CPU seconds of this process (the server runs in a thread of it) and of its reaped children (the
    launchers, and through them every process of every sandbox): a figure that a busy machine does not skew."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--opens", type=int, default=20)
    parser.add_argument("--verifies", type=int, default=10)
    parser.add_argument("--only", choices=["verify"], help="run one part alone")
    args = parser.parse_args()
    uid_base = random.randrange(20000, 39000, 200)
    with tempfile.TemporaryDirectory(prefix="bench-sandbox-") as folder:
        repos = Path(folder) / "repos"
        build([ROW], repos)
        if args.only == "verify":
            bench_verify(repos, args.verifies, uid_base)
            bench_verify(repos, args.verifies, uid_base, submit=False)
            return 0
        server = SweServer(SweServerConfig(repos_dir=str(repos), templates_dir=str(Path(folder) / "templates")), name="t")
        import asyncio

        from resources_servers.swe.app import SweTask

        template = asyncio.run(server.template(SweTask(**ROW)))
        server.provider.shutdown()
        print(f"machine: {os.cpu_count()} cores; template: the parse repository ({du(template)})")
        bench_start(template, args.opens, uid_base)
        bench_concurrent(template, args.sessions, uid_base + 100)
        escape_table(repos, uid_base + 180)
        bench_verify(repos, args.verifies, uid_base + 160)
        bench_verify(repos, args.verifies, uid_base + 160, submit=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
