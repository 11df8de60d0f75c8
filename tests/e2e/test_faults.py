"""Fault tolerance: kill -9 the collector and resume, a flaky/hanging backend, a server killed mid-run
and restarted on its port, `rollgym run` noticing a dead child, 1,000 concurrent sessions on one
environment, and the security rules (no open bind without a token, bearer auth through the real
launcher, tampered session cookies).

Every stack here is real: `rollgym run` / `rollgym collect-rollouts` subprocesses or `rollgym.Stack`
children, with scripts/scripted_backend.py standing in for vLLM. Each test is bounded (< 60 s on a
loaded 2-core machine): every wait has a deadline and every subprocess a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlparse

import aiohttp
import orjson
import psutil
import pytest

from rollgym import CollectOptions, Collector, ServerClient, Stack, load_stack
from rollgym.rollouts.collector import read_tasks
from rollgym.config import ServerSpec, StackConfig
from rollgym.schema import FAILURE_STATUSES, POLICY_STATUSES
from rollgym.sessions import SESSION_COOKIE
from rollgym.testing import REPO_ROOT, scripted_backend, serve_in_thread
from tests.conftest import start_rollgym, stop_rollgym

WEATHER_YAML = str(REPO_ROOT / "resources_servers/weather/configs/weather.yaml")
CHAT_YAML = str(REPO_ROOT / "models/chat_completions/configs/chat_completions.yaml")
KNOWN = [("Paris", ["sunny", "22"]), ("London", ["rainy", "14"]), ("Tokyo", ["cloudy"]), ("Oslo", ["snowy", "-3"])]
TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


# --- helpers ----------------------------------------------------------------------------------------


def weather_row(city: str, expected: list[str]) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [TOOL]}, "city": city, "expected": expected}


def make_tasks(path: Path, count: int) -> list[str]:
    """`count` weather tasks; returns their group ids in order (as the collector derives them)."""
    with path.open("w") as handle:
        for index in range(count):
            city, expected = KNOWN[index % len(KNOWN)]
            handle.write(json.dumps(weather_row(city, expected)) + "\n")
    tasks, problems = read_tasks(path)
    assert not problems
    return [task.group_id for task in tasks]


def expected_ids(group_ids: list[str], repeats: int) -> set[str]:
    return {f"{group}-r{k}" for group in group_ids for k in range(repeats)}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSONL file, parsed; fails on a torn or unparseable line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), f"{path} ends with a torn line: {data[-200:]!r}"
    return [orjson.loads(line) for line in data.splitlines() if line.strip()]


def complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def rollgym_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rollgym.cli", *args]


@contextmanager
def rollgym_run(tmp: Path, backend_url: str, *overrides: str, timeout_s: float = 45.0,
                umask: int | None = None) -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """`rollgym run weather + chat_completions` as a user starts it; yields (process, registry file, stderr file)."""
    registry = tmp / f"registry-{time.monotonic_ns()}.json"
    stderr_path = registry.with_suffix(".stderr")
    with stderr_path.open("wb") as stderr:
        process = start_rollgym(
            "run", WEATHER_YAML, CHAT_YAML, f"policy_model.base_url={backend_url}", "policy_model.model=scripted",
            *overrides, "--registry-file", str(registry), stdout=subprocess.DEVNULL, stderr=stderr,
            preexec_fn=(lambda: os.umask(umask)) if umask is not None else None,
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                raise AssertionError(f"rollgym run exited with {process.returncode}:\n{stderr_path.read_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"rollgym run not ready in {timeout_s} s:\n{stderr_path.read_text()}")
            try:
                json.loads(registry.read_bytes())
                break
            except (FileNotFoundError, ValueError):
                time.sleep(0.05)
        yield process, registry, stderr_path
    finally:
        stop_rollgym(process, grace_s=20)


def collect_cmd(registry: Path, tasks: Path, output: Path, *extra: str) -> list[str]:
    return rollgym_cli("collect-rollouts", "--registry-file", str(registry), "--input", str(tasks),
                       "--output", str(output), "--no-progress", *extra)


def companions(output: Path) -> tuple[Path, Path]:
    stem = output.with_suffix("")
    return stem.with_name(stem.name + ".failures.jsonl"), stem.with_name(stem.name + ".metrics.json")


@contextmanager
def quiet_server_logs() -> Iterator[None]:
    """Silence the traces in-thread servers log for an expected 500 (rollgym's and uvicorn's).

    Python 3.11 formats a logged traceback with ast.parse, whose recursion counter all threads share:
    a server thread logging while pytest formats a failure can raise "SystemError: AST constructor
    recursion depth mismatch" (an INTERNALERROR that hides the failure).
    """
    # logging.disable, not logger levels: uvicorn.Config resets the levels of its loggers.
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


def wait_healthy(url: str, timeout_s: float = 30.0, headers: dict[str, str] | None = None) -> None:
    async def probe() -> None:
        deadline = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while True:
                try:
                    async with http.get(url + "/health", headers=headers or {},
                                        timeout=aiohttp.ClientTimeout(total=1)) as reply:
                        if reply.status == 200:
                            return
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                    pass
                assert time.monotonic() < deadline, f"{url} not healthy in {timeout_s} s"
                await asyncio.sleep(0.05)

    asyncio.run(probe())


# --- kill -9 the collector, resume ----------------------------------------------------------------------


def test_kill9_collector_twice_then_resume(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    repeats, count = 4, 30
    total = repeats * count
    tasks = tmp_path / "tasks.jsonl"
    ids = expected_ids(make_tasks(tasks, count), repeats)
    output = tmp_path / "rollouts.jsonl"
    failures_path, metrics_path = companions(output)
    # 20 ms per model call and 8 rollouts in flight: at most ~200 rollouts/s; the output is polled every
    # 3 ms, so the kill lands mid-run, within a line or two of its target.
    with scripted_backend("--latency-ms", "20") as backend_url, rollgym_run(tmp_path, backend_url) as (_, registry, _):
        cmd = collect_cmd(registry, tasks, output, "--repeats", str(repeats), "--concurrency", "8")
        killed_at = []
        for low, high in ((0.10, 0.45), (0.50, 0.90)):
            target = rng.randint(math.ceil(low * total), math.floor(high * total) - 2)
            process = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.monotonic() + 40
            while complete_lines(output) < target:
                assert process.poll() is None, f"collector ended before the kill (seed {seed}): {process.stderr.read()!r}"
                assert time.monotonic() < deadline, f"collector too slow (seed {seed})"
                time.sleep(0.003)
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
            process.stderr.close()
            assert process.returncode == -signal.SIGKILL
            lines = complete_lines(output)
            assert 0.10 * total <= lines <= 0.90 * total, (seed, lines)
            killed_at.append(lines)
        assert killed_at[0] < killed_at[1]

        # A kill can also land inside a write; emulate the torn tail it would leave.
        last = output.read_bytes().splitlines()[-1]
        with output.open("ab") as handle:
            handle.write(last[: len(last) // 2])

        started = time.monotonic()
        final = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=45)
        assert final.returncode == 0, final.stderr
        assert time.monotonic() - started < 45
    assert "repaired a torn last line" in final.stderr
    assert f"resuming: {killed_at[1]} of {total} rollouts already" in final.stderr, final.stderr

    rollouts = read_jsonl(output)  # every line parses; no torn line left
    got = Counter(r["rollout_id"] for r in rollouts)
    assert len(rollouts) == total and set(got) == ids and max(got.values()) == 1
    assert all(r["status"] == "ok" and isinstance(r["reward"], float) for r in rollouts)
    assert read_jsonl(failures_path) == []
    metrics = json.loads(metrics_path.read_text())
    assert metrics["rollouts"] == total and metrics["failed"] == 0 and metrics["status_counts"] == {"ok": total}
    assert metrics["groups"] == count


# --- a flaky backend --------------------------------------------------------------------------------


def test_flaky_backend_every_rollout_is_a_reward_or_a_recorded_failure(tmp_path: Path) -> None:
    repeats, count, max_attempts = 2, 60, 3
    tasks = tmp_path / "tasks.jsonl"
    ids = expected_ids(make_tasks(tasks, count), repeats)
    output = tmp_path / "flaky.jsonl"
    failures_path, metrics_path = companions(output)
    seed = str(random.randrange(1 << 30))
    # The agent does not retry the model server itself, so a hang (model server timeout → 504) becomes a
    # model_error that the collector must record and retry.
    overrides = ("policy_model.timeout_s=2", "policy_model.max_retries=2", "weather_agent.client_max_retries=0")
    with scripted_backend("--fail-rate", "0.1", "--hang-rate", "0.02", "--seed", seed) as backend_url, \
            rollgym_run(tmp_path, backend_url, *overrides) as (_, registry, _):
        started = time.monotonic()
        result = subprocess.run(
            collect_cmd(registry, tasks, output, "--repeats", str(repeats), "--concurrency", "32",
                        "--max-attempts", str(max_attempts)),
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=55,
        )
        wall = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert wall < 50, f"collection took {wall:.1f} s (backend seed {seed})"

    rollouts = read_jsonl(output)
    failures = read_jsonl(failures_path)
    out_ids = [r["rollout_id"] for r in rollouts]
    assert len(out_ids) == len(set(out_ids)), "a rollout was written twice"
    for rollout in rollouts:
        # A failure is never a reward: what is in the output was produced by the policy and verified.
        assert rollout["status"] in POLICY_STATUSES and rollout["status"] not in FAILURE_STATUSES, rollout["status"]
        assert isinstance(rollout["reward"], float) and rollout["error"] is None
    attempts: dict[str, list[int]] = defaultdict(list)
    final_ids = set()
    for record in failures:
        assert "reward" not in record
        assert record["status"] in FAILURE_STATUSES | {"agent_error"}, record
        assert isinstance(record["error"], str) and record["error"], record
        assert 1 <= record["attempt"] <= max_attempts, record
        assert record["final"] == (record["attempt"] == max_attempts), record
        attempts[record["rollout_id"]].append(record["attempt"])
        if record["final"]:
            final_ids.add(record["rollout_id"])
    for rollout_id, tried in attempts.items():
        assert tried == list(range(1, len(tried) + 1)), (rollout_id, tried)  # 1, 2, ... in order, no gap
        assert rollout_id in final_ids or rollout_id in out_ids, f"{rollout_id} failed, was not retried to the end"
    assert not final_ids & set(out_ids)
    assert final_ids | set(out_ids) == ids

    metrics = json.loads(metrics_path.read_text())
    assert metrics["rollouts"] == len(rollouts) and metrics["failed"] == len(final_ids)
    assert set(metrics["status_counts"]) <= POLICY_STATUSES
    rewards = [r["reward"] for r in rollouts]
    if rewards:
        assert metrics["mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
    print(f"flaky backend (seed {seed}): {len(rollouts)} ok, {len(failures)} failed attempts, "
          f"{len(final_ids)} final failures, {wall:.1f} s")


def _generation_requests(backend_url: str) -> int:
    """How many generation requests (chat or completions) the scripted backend has received."""
    with urllib.request.urlopen(backend_url.removesuffix("/v1") + "/scripted/requests", timeout=10) as reply:
        log = json.loads(reply.read())["requests"]
    return sum(1 for entry in log if entry["path"] in ("/v1/chat/completions", "/v1/completions"))


def test_a_backend_that_always_fails_gets_a_bounded_number_of_requests_per_rollout(tmp_path: Path) -> None:
    # One retry layer per hop (docs/data-formats.md, "Retries"): the model server tries its backend
    # 1 + max_retries times, the agent does not retry the model server's 429/5xx answer, and the
    # collector attempts the rollout --max-attempts times: 3 × 3 backend requests per rollout here
    # (48 when the agent's client retried the model server as well).
    tasks = tmp_path / "tasks.jsonl"
    make_tasks(tasks, 2)
    output = tmp_path / "failing.jsonl"
    failures_path, _ = companions(output)
    with scripted_backend("--fail-rate", "1") as backend_url, \
            rollgym_run(tmp_path, backend_url, "policy_model.max_retries=2") as (_, registry, _):
        result = subprocess.run(collect_cmd(registry, tasks, output, "--max-attempts", "3"),
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=55)
        sent = _generation_requests(backend_url)
        assert result.returncode == 1, result.stdout + result.stderr  # no rollout succeeded
        assert sent == 2 * 3 * 3, f"{sent} backend requests for 2 rollouts"
        assert read_jsonl(output) == []  # a failure is never a reward
        failures = read_jsonl(failures_path)
        assert sorted((f["group_id"], f["attempt"]) for f in failures) == \
            sorted((group, attempt) for group in {f["group_id"] for f in failures} for attempt in (1, 2, 3))
        assert {f["status"] for f in failures} == {"model_error"} and sum(f["final"] for f in failures) == 2

        # The per-rollout budget bounds the attempts in time whatever --max-attempts says.
        budgeted = tmp_path / "budgeted.jsonl"
        started = time.monotonic()
        result = subprocess.run(collect_cmd(registry, tasks, budgeted, "--max-attempts", "50", "--rollout-budget-s", "2"),
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=55)
        wall = time.monotonic() - started
        extra = _generation_requests(backend_url) - sent
    assert result.returncode == 1, result.stdout + result.stderr
    attempts = read_jsonl(companions(budgeted)[0])
    assert all(f["status"] in FAILURE_STATUSES for f in attempts) and sum(f["final"] for f in attempts) == 2
    assert 2 <= len(attempts) < 2 * 50 and extra == 3 * len(attempts), (len(attempts), extra)
    assert wall < 2 + 15, f"collection took {wall:.1f} s with a 2 s budget per rollout"
    assert read_jsonl(budgeted) == []


# --- a server dies mid-run ----------------------------------------------------------------------------


def _collect_in_thread(registry: dict, tasks: Path, output: Path, **options: Any) -> tuple[threading.Thread, dict]:
    outcome: dict[str, Any] = {}

    def work() -> None:
        async def main() -> dict:
            client = ServerClient(registry, timeout_s=60, max_retries=2)
            try:
                opts = CollectOptions(input=tasks, output=output, progress=False, **options)
                return await Collector(client, "weather_agent", opts, log=lambda m: None).run()
            finally:
                await client.close()

        try:
            outcome["summary"] = asyncio.run(main())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, outcome


def test_weather_killed_mid_run_fails_in_flight_rollouts_then_recovers_on_restart(tmp_path: Path) -> None:
    count = 400
    tasks = tmp_path / "tasks.jsonl"
    ids = expected_ids(make_tasks(tasks, count), 1)
    output = tmp_path / "run.jsonl"
    failures_path, _ = companions(output)
    with scripted_backend("--latency-ms", "40") as backend_url:
        config = load_stack([WEATHER_YAML, CHAT_YAML], [f"policy_model.base_url={backend_url}", "policy_model.model=scripted"])
        stack = Stack(config)
        replacement: subprocess.Popen | None = None
        try:
            registry = stack.start(timeout_s=45)
            port = urlparse(registry["weather"].url).port
            stack_file = Path(stack._state_dir.name) / "stack.json"  # the running stack's file: same secret
            thread, outcome = _collect_in_thread(registry, tasks, output, concurrency=16, max_attempts=1)
            deadline = time.monotonic() + 40
            while complete_lines(output) < 20:
                assert thread.is_alive(), outcome
                assert time.monotonic() < deadline, "no progress before the kill"
                time.sleep(0.01)
            stack.kill("weather")
            assert stack.dead() == ("weather", -9)
            before_kill = complete_lines(output)

            # Restart: a fresh `python -m rollgym.stack.serve` on the same port, as the launcher would spawn it.
            time.sleep(1.0)  # let in-flight rollouts hit the dead server
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen(4096)
            sock.set_inheritable(True)
            replacement = subprocess.Popen(
                [sys.executable, "-m", "rollgym.stack.serve", str(stack_file), "weather", "--fd", str(sock.fileno())],
                cwd=REPO_ROOT, pass_fds=(sock.fileno(),),
            )
            sock.close()
            wait_healthy(registry["weather"].url)
            at_restart = complete_lines(output)

            thread.join(timeout=45)
            assert not thread.is_alive(), "the collector hung after the server died"
            assert "error" not in outcome, outcome.get("error")

            rollouts = read_jsonl(output)
            failures = read_jsonl(failures_path)
            ok_ids = {r["rollout_id"] for r in rollouts}
            failed_ids = {f["rollout_id"] for f in failures}
            assert failures, "killing the environment failed no rollout"
            # In-flight rollouts end as env_error (the environment is gone), never as a reward or a hang.
            assert {f["status"] for f in failures} == {"env_error"}, Counter(f["status"] for f in failures)
            assert all("weather" in f["error"] and f["final"] for f in failures)
            assert all(r["status"] == "ok" and isinstance(r["reward"], float) for r in rollouts)
            assert ok_ids | failed_ids == ids and not ok_ids & failed_ids
            assert len(rollouts) > at_restart >= before_kill, "no rollout succeeded after the restart"
            assert outcome["summary"]["failed"] == len(failed_ids)

            # Later rollouts all succeed against the restarted server.
            later_tasks = tmp_path / "later.jsonl"
            later_ids = expected_ids(make_tasks(later_tasks, 20), 1)
            later = tmp_path / "later-out.jsonl"
            thread, outcome = _collect_in_thread(registry, later_tasks, later, concurrency=8, max_attempts=1)
            thread.join(timeout=30)
            assert not thread.is_alive() and "error" not in outcome
            after = read_jsonl(later)
            assert {r["rollout_id"] for r in after} == later_ids
            assert all(r["status"] == "ok" and r["reward"] == 1.0 for r in after)
            assert read_jsonl(companions(later)[0]) == []
        finally:
            if replacement is not None:
                replacement.terminate()
                try:
                    replacement.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    replacement.kill()
                    replacement.wait()
            stack.stop()


def test_rollgym_run_reports_a_killed_child_and_exits_nonzero(tmp_path: Path) -> None:
    # No backend is needed for the stack to come up (health does not call it).
    with rollgym_run(tmp_path, "http://127.0.0.1:9/v1") as (process, registry, stderr_path):
        port = urlparse(json.loads(registry.read_bytes())["weather"]["url"]).port
        children = psutil.Process(process.pid).children()
        assert len(children) == 3, children

        def listens_on(child: psutil.Process) -> bool:
            try:
                return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in child.net_connections("tcp"))
            except psutil.Error:
                return False

        weather = [child for child in children if listens_on(child)]
        assert len(weather) == 1, "cannot find the weather child by its port"
        os.kill(weather[0].pid, signal.SIGKILL)
        process.wait(timeout=20)
        assert process.returncode == 1
        stderr = stderr_path.read_text()
        assert "server 'weather' exited with code -9" in stderr, stderr
        assert "Traceback" not in stderr
        gone, alive = psutil.wait_procs([c for c in children if c.pid != weather[0].pid], timeout=15)
        assert not alive, f"children left running after the launcher exited: {alive}"


# --- session isolation ----------------------------------------------------------------------------------


def inventory_stack() -> StackConfig:
    spec = ServerSpec(name="inventory", role="resources_servers", folder="inventory", entrypoint="app.py",
                      options={}, source="tests/test_faults.py", root=str(REPO_ROOT))
    return StackConfig({"inventory": spec})


def test_1000_concurrent_sessions_each_see_only_their_own_state() -> None:
    from resources_servers.inventory.app import (
        InventoryTask, add_item, inventory_reward, new_world, remove_item, transfer,
    )

    sessions, steps = 1000, 4
    locations = ["warehouse", "store", "outlet"]
    tools = {"add_item": add_item, "remove_item": remove_item, "transfer": transfer}

    def plan(i: int) -> tuple[dict[str, Any], list[tuple[str, dict[str, Any]]]]:
        rng = random.Random(i)
        items = ["apple", "pear", f"own{i}"]
        initial = {loc: {item: rng.randint(0, 12) for item in items if rng.random() < 0.7} for loc in locations}
        row = {"responses_create_params": {"input": f"session {i}"}, "initial": initial,
               "target": {"store": {f"own{i}": i % 5}}}
        ops = []
        for _ in range(steps):
            name = rng.choice(list(tools))
            item, quantity = rng.choice(items), rng.randint(1, 10)  # some removes/transfers must be refused
            if name == "transfer":
                source, dest = rng.sample(locations, 2)
                ops.append((name, {"item": item, "quantity": quantity, "from_location": source, "to_location": dest}))
            else:
                ops.append((name, {"location": rng.choice(locations), "item": item, "quantity": quantity}))
        return row, ops

    async def drive(url: str) -> list[str]:
        problems: list[str] = []
        seeded = asyncio.Event()
        seeded_count = 0
        connector = aiohttp.TCPConnector(limit=200)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(), timeout=timeout) as http:

            async def post(path: str, body: Any, cookie: str | None) -> tuple[int, bytes, str | None]:
                headers = {"Cookie": f"{SESSION_COOKIE}={cookie}"} if cookie else {}
                async with http.post(url + path, data=orjson.dumps(body), headers=headers) as reply:
                    new = reply.cookies.get(SESSION_COOKIE)
                    return reply.status, await reply.read(), new.value if new else None

            async def one(i: int) -> None:
                nonlocal seeded_count
                row, ops = plan(i)
                world = new_world(InventoryTask.model_validate(row))
                status, body, cookie = await post("/seed_session", row, None)
                assert status == 200 and cookie, (status, body)
                seeded_count += 1
                if seeded_count == sessions:
                    seeded.set()
                await seeded.wait()  # all 1,000 sessions exist before any of them changes its world
                for name, args in ops:  # 200 pooled connections: the sessions' calls interleave
                    status, body, new_cookie = await post(f"/{name}", args, cookie)
                    expected = tools[name](world, **args)
                    if status != 200 or new_cookie or body.decode() != expected:
                        problems.append(f"session {i} {name} {args}: {status} {body[:200]!r} != {expected!r}")
                        return
                response = {"id": "r", "object": "response", "created_at": 0, "model": "m", "parallel_tool_calls": True,
                            "tool_choice": "auto", "tools": [], "output": []}
                status, body, _ = await post("/verify", {**row, "response": response}, cookie)
                verdict = orjson.loads(body)
                reward, _ = inventory_reward(world["stock"], InventoryTask.model_validate(row).target)
                if status != 200 or verdict["final_stock"] != world["stock"] or verdict["reward"] != reward:
                    problems.append(f"session {i} verify: {status} {body[:300]!r}")

            results = await asyncio.gather(*(one(i) for i in range(sessions)), return_exceptions=True)
            problems.extend(f"session {i}: {r!r}" for i, r in enumerate(results) if isinstance(r, BaseException))
        return problems

    with Stack(inventory_stack()) as registry:
        started = time.monotonic()
        problems = asyncio.run(asyncio.wait_for(drive(registry["inventory"].url), timeout=50))
        elapsed = time.monotonic() - started
    assert not problems, f"{len(problems)} sessions saw other state, e.g. {problems[:3]}"
    print(f"{sessions} sessions x {steps + 2} calls in {elapsed:.1f} s")


# --- security -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["override", "config file"])
def test_open_bind_without_token_is_refused_by_rollgym_run(tmp_path: Path, how: str) -> None:
    if how == "override":
        configs = [WEATHER_YAML, CHAT_YAML, "weather.host=0.0.0.0"]
    else:
        config = tmp_path / "open_weather.yaml"
        config.write_text("weather:\n  resources_servers:\n    weather:\n      entrypoint: app.py\n      host: 0.0.0.0\n"
                          "weather_agent:\n  agents:\n    simple_agent:\n      entrypoint: app.py\n"
                          "      model_server: {name: policy_model}\n      resources_server: {name: weather}\n")
        configs = [str(config), CHAT_YAML]
    result = subprocess.run(rollgym_cli("run", *configs, "policy_model.base_url=http://127.0.0.1:9/v1"),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=45)
    assert result.returncode != 0
    assert "server 'weather' would listen on 0.0.0.0, beyond loopback, without auth_token" in result.stderr, result.stderr
    assert "set auth_token" in result.stderr
    assert "Traceback" not in result.stderr


TOKEN = "t0ken-" + "x" * 26


@pytest.fixture(scope="module")
def token_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict[str, Any], Path]]:
    """`rollgym run` with the weather server open on 0.0.0.0 behind a bearer token."""
    tmp = tmp_path_factory.mktemp("token")
    with scripted_backend() as backend_url, \
            rollgym_run(tmp, backend_url, "weather.host=0.0.0.0", f"weather.auth_token={TOKEN}", umask=0o022) as (_, registry, _):
        yield json.loads(registry.read_bytes()), registry


def test_bearer_token_through_the_real_launcher(token_stack: tuple[dict[str, Any], Path]) -> None:
    registry, _ = token_stack
    weather, agent = registry["weather"]["url"], registry["weather_agent"]["url"]
    assert registry["weather"]["auth_token"] == TOKEN

    async def check() -> None:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
            row = weather_row("Paris", ["sunny"])
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                            {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):
                for method, path, body in (("POST", "/seed_session", row), ("POST", "/get_weather", {"city": "Oslo"}),
                                           ("GET", "/tools", None), ("GET", "/openapi.json", None)):
                    async with http.request(method, weather + path, json=body, headers=headers) as reply:
                        assert reply.status == 401, (headers, path, reply.status)
                        assert reply.headers.get("WWW-Authenticate") == "Bearer"
                        assert (await reply.json(content_type=None))["error"]["type"] == "unauthorized"
            good = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(weather + "/health") as reply:  # health stays open for the launcher
                assert reply.status == 200
            async with http.post(weather + "/seed_session", json=row, headers=good) as reply:
                assert reply.status == 200
            async with http.post(weather + "/get_weather", json={"city": "Oslo"}, headers=good) as reply:
                assert reply.status == 200 and (await reply.text()) == "Oslo: snowy, -3 C"
            # The launcher gave the agent the weather token: a whole rollout goes through.
            async with http.post(agent + "/run", json=row, timeout=aiohttp.ClientTimeout(total=30)) as reply:
                assert reply.status == 200
                rollout = await reply.json()
                assert rollout["status"] == "ok" and rollout["reward"] == 1.0 and rollout["looked_up"] == ["Paris"]

    asyncio.run(check())


def test_registry_file_holding_tokens_is_private(token_stack: tuple[dict[str, Any], Path]) -> None:
    _, path = token_stack
    assert TOKEN in path.read_text()
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)


def test_tampered_session_cookie_is_a_new_session_never_another_one() -> None:
    from resources_servers.inventory.app import InventoryServer
    from resources_servers.weather.app import WeatherServer

    response = {"id": "r", "object": "response", "created_at": 0, "model": "m", "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": [], "output": []}

    async def check(weather: str, inventory: str) -> None:
        # A fresh connection per request: a 500 closes its connection (see the keep-alive test below).
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar()) as http:

            async def post(url: str, path: str, body: Any, cookie: str | None = None) -> tuple[int, Any, str | None]:
                headers = {"Cookie": f"{SESSION_COOKIE}={cookie}"} if cookie is not None else {}
                async with http.post(url + path, json=body, headers=headers) as reply:
                    new = reply.cookies.get(SESSION_COOKIE)
                    raw = await reply.read()
                    try:
                        payload = orjson.loads(raw)
                    except orjson.JSONDecodeError:
                        payload = raw.decode()
                    return reply.status, payload, new.value if new else None

            row = weather_row("Paris", ["sunny"])
            _, _, cookie_a = await post(weather, "/seed_session", row)
            _, _, cookie_b = await post(weather, "/seed_session", row)
            await post(weather, "/get_weather", {"city": "Paris"}, cookie_a)
            await post(weather, "/get_weather", {"city": "Tokyo"}, cookie_b)
            sid_a, _, sig_a = cookie_a.rpartition(".")
            sid_b, _, sig_b = cookie_b.rpartition(".")
            flipped = sig_a[:-1] + ("0" if sig_a[-1] != "0" else "1")
            tampered = [
                f"{sid_a}.{flipped}",              # signature changed
                f"{sid_a[:-1]}{'A' if sid_a[-1] != 'A' else 'B'}.{sig_a}",  # id changed
                f"{sid_b}.{sig_a}",                # another session's id under this signature
                f"{sid_a}.{sig_a.upper()}",        # case-folded signature
                f"{sid_a}.",                       # no signature
                sid_a,                             # id alone
                f".{sig_a}",
                f"{sid_a}.{sig_a}.{sig_a}",
                "x" * 4096,
                f"{sid_a}.{sig_a[:16]}",          # truncated signature
            ]
            other = WeatherServer(name="weather").session_signer.new()[1]  # signed under another secret
            tampered.append(other)
            for cookie in tampered:
                status, verdict, new = await post(weather, "/verify", {**row, "response": response}, cookie)
                assert status == 200 and new is not None, (cookie, status, verdict)
                new_sid = new.rpartition(".")[0]
                assert new_sid not in (sid_a, sid_b)
                assert verdict["looked_up"] == [], (cookie, verdict["looked_up"])
            # The genuine cookies still see exactly their own state.
            status, verdict, new = await post(weather, "/verify", {**row, "response": response}, cookie_a)
            assert status == 200 and new is None and verdict["looked_up"] == ["Paris"]
            status, verdict, new = await post(weather, "/verify", {**row, "response": response}, cookie_b)
            assert status == 200 and new is None and verdict["looked_up"] == ["Tokyo"]

            # Inventory: a tampered cookie never reaches the seeded world (a new, unseeded session).
            inv_row = {"responses_create_params": {"input": "x"}, "initial": {"store": {"apple": 3}},
                       "target": {"store": {"apple": 3}}}
            status, _, cookie_i = await post(inventory, "/seed_session", inv_row)
            assert status == 200
            sid_i, _, sig_i = cookie_i.rpartition(".")
            for cookie in (f"{sid_i}.{sig_i[::-1]}", f"{sid_i}x.{sig_i}", sid_i):
                status, payload, new = await post(inventory, "/list_inventory", {}, cookie)
                assert new is None or new.rpartition(".")[0] != sid_i
                assert status == 500 and "SessionNotSeeded" in payload["error"]["message"], payload  # documented
            status, payload, _ = await post(inventory, "/list_inventory", {}, cookie_i)
            assert status == 200 and payload == {"store": {"apple": 3}}

    with quiet_server_logs(), serve_in_thread(WeatherServer(name="weather")) as weather, \
            serve_in_thread(InventoryServer(name="inventory")) as inventory:
        asyncio.run(check(weather, inventory))


# --- a torn failures file ----------------------------------------------------------------------------------


def test_torn_failures_file_is_repaired_on_resume(tmp_path: Path) -> None:
    tasks = tmp_path / "tasks.jsonl"
    make_tasks(tasks, 2)
    output = tmp_path / "out.jsonl"
    failures_path, _ = companions(output)
    # What a kill -9 in the middle of writing a failure record leaves behind.
    failures_path.write_bytes(b'{"rollout_id":"L000001-0-r0","group_id":"L0000')

    async def run() -> None:
        # Nothing listens on port 9: every attempt is an agent_error, written to the failures file.
        client = ServerClient({}, timeout_s=5, max_retries=0)
        try:
            options = CollectOptions(input=tasks, output=output, max_attempts=1, progress=False)
            await Collector(client, "http://127.0.0.1:9", options, log=lambda m: None).run()
        finally:
            await client.close()

    asyncio.run(run())
    records = read_jsonl(failures_path)  # every line must parse
    assert len(records) == 2


# --- a 500 and keep-alive -------------------------------------------------------------------------------


def test_a_500_answer_keeps_the_connection_usable() -> None:
    from resources_servers.inventory.app import InventoryServer

    with quiet_server_logs(), serve_in_thread(InventoryServer(name="inventory")) as url:
        port = urlparse(url).port
        request = (b"POST /list_inventory HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                   b"Content-Length: 2\r\n\r\n{}")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(request)  # an unseeded session: a documented 500 (env failure)
            first = _read_response(conn)
            assert first.startswith(b"HTTP/1.1 500")
            if b"connection: close" in first.lower():
                return  # the server said it would close: a client would not reuse the connection
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            second = _read_response(conn)
            assert second.startswith(b"HTTP/1.1 200"), second


def _read_response(conn: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")), 0)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body
