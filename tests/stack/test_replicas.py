"""Replicas: `replicas: N` in a stack config starts N processes; the client spreads sessions over them,
a session sticks to its replica, and with the SQLite session store a session outlives its replica."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from aiohttp import web

from rollgym.client import (
    REPLICA_KEY_PREFIX,
    ServerAddress,
    ServerCallError,
    ServerClient,
    parse_registry_items,
    registry_from_json,
)
from rollgym.config import ConfigError, load_stack
from rollgym.model import build_response
from rollgym.testing import REPO_ROOT, scripted_backend
from tests.conftest import start_rollgym, stop_rollgym

WEATHER = REPO_ROOT / "resources_servers/weather/configs/weather.yaml"
CHAT = REPO_ROOT / "models/chat_completions/configs/chat_completions.yaml"
TOOL = {"type": "function", "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CITIES = [("Paris", "sunny"), ("London", "rainy"), ("Tokyo", "cloudy"), ("Oslo", "snowy"), ("Lima", "foggy")]


def weather_row(city: str, expected: str) -> dict:
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [TOOL]}, "city": city, "expected": [expected]}


# --- config ---------------------------------------------------------------------------------------


def test_replicas_and_ray_resources_are_the_stacks_keys_not_the_servers() -> None:
    stack = load_stack([WEATHER, CHAT], ["weather.replicas=3", "weather.ray_resources.num_cpus=0.5",
                                         "policy_model.ray_resources.num_gpus=1"])
    weather = stack.servers["weather"]
    assert weather.replicas == 3 and weather.ray_resources == {"num_cpus": 0.5}
    assert "replicas" not in weather.options and "ray_resources" not in weather.options
    assert stack.servers["policy_model"].ray_resources == {"num_gpus": 1.0}
    assert stack.servers["weather_agent"].replicas == 1 and stack.servers["weather_agent"].ray_resources == {}


@pytest.mark.parametrize(("override", "message"), [
    ("weather.replicas=0", "key 'weather.resources_servers.weather.replicas': must be a whole number of at least 1"),
    ("weather.replicas=two", "key 'weather.resources_servers.weather.replicas'"),
    ("weather.ray_resources.num_gpu=1", "key 'weather.resources_servers.weather.ray_resources.num_gpu': unknown option"),
    ("weather.ray_resources.num_cpus=-1", "key 'weather.resources_servers.weather.ray_resources.num_cpus'"),
])
def test_bad_replicas_or_resources_name_the_file_and_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_stack([WEATHER, CHAT], [override])
    assert message in str(info.value) and str(WEATHER) in str(info.value)


def test_registry_json_forms_round_trip() -> None:
    registry = registry_from_json({
        "one": "http://a:1/",
        "many": ["http://b:1", "http://b:2"],
        "shared": {"urls": ["http://c:1", "http://c:2"], "role": "resources_servers", "shared_sessions": True},
        "old": {"url": "http://d:1", "role": "agents", "auth_token": "own"},
    }, auth_token="stack-token")
    assert registry["one"] == ServerAddress("http://a:1", auth_token="stack-token")
    assert registry["many"].urls == ("http://b:1", "http://b:2") and registry["many"].url == "http://b:1"
    assert registry["shared"].shared_sessions and registry["old"].auth_token == "own"
    assert registry_from_json({name: a.to_json() for name, a in registry.items()}) == registry
    assert parse_registry_items(["w=http://w:1,http://w:2"])["w"].urls == ("http://w:1", "http://w:2")
    with pytest.raises(ValueError, match="NAME=http"):
        parse_registry_items(["w=w:1"])


# --- the client against three replicas ---------------------------------------------------------------


async def start_replicas(count: int) -> tuple[list[web.AppRunner], list[str], list[list[str]]]:
    """`count` servers that record each call's session cookie and set one when it has none."""
    runners, urls, seen = [], [], []
    for index in range(count):
        calls: list[str] = []

        async def handler(request: web.Request, index: int = index, calls: list[str] = calls) -> web.Response:
            session = request.cookies.get("sid") or f"r{index}-{len(calls)}"
            calls.append(session)
            reply = web.json_response({"replica": index, "session": session, "cookies": dict(request.cookies)})
            reply.set_cookie("sid", session)
            return reply

        app = web.Application()
        app.router.add_post("/call", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
        seen.append(calls)
    return runners, urls, seen


async def test_sessions_spread_and_stick_and_move_only_when_state_is_shared() -> None:
    runners, urls, seen = await start_replicas(3)
    registry = {"env": ServerAddress.replicated(urls), "shared": ServerAddress.replicated(urls, shared_sessions=True)}
    client = ServerClient(registry, max_retries=1, backoff_base_s=0.001)
    try:
        sessions = [{} for _ in range(9)]
        for cookies in sessions:  # one call each: sessions are dealt over the replicas
            await client.post("env", "/call", json={}, cookies=cookies)
        for _ in range(3):  # later calls of a session go where it started, carrying only its real cookie
            replies = await asyncio.gather(*(client.post("env", "/call", json={}, cookies=c) for c in sessions))
            for cookies, reply in zip(sessions, replies):
                assert urls[reply.json()["replica"]] == cookies[REPLICA_KEY_PREFIX + "env"]
                assert reply.json()["cookies"] == {"sid": cookies["sid"]}
        assert [len(calls) for calls in seen] == [12, 12, 12]
        assert all(len(set(calls)) == 3 for calls in seen)  # three sessions per replica, none crossed over

        # Calls without a session go round-robin / least loaded.
        replies = await asyncio.gather(*(client.post("env", "/call", json={}) for _ in range(30)))
        assert sorted(r.json()["replica"] for r in replies) == [0] * 10 + [1] * 10 + [2] * 10

        # Replica 0 goes away.
        await runners[0].cleanup()
        lost = next(c for c in sessions if c[REPLICA_KEY_PREFIX + "env"] == urls[0])
        with pytest.raises(ServerCallError) as info:  # its state was there: fail, never silently move
            await client.post("env", "/call", json={}, cookies=lost)
        assert info.value.kind == "connect"
        moved = dict(lost)
        reply = await client.post("shared", "/call", json={}, cookies=moved)  # shared state: move on
        assert reply.ok and reply.json()["replica"] in (1, 2)
        assert moved[REPLICA_KEY_PREFIX + "shared"] == urls[reply.json()["replica"]]
        replies = await asyncio.gather(*(client.post("env", "/call", json={}) for _ in range(10)))
        assert all(r.json()["replica"] in (1, 2) for r in replies)  # new work avoids the dead replica
    finally:
        await client.close()
        for runner in runners[1:]:
            await runner.cleanup()


# --- real stacks --------------------------------------------------------------------------------------


def replica_requests(urls: tuple[str, ...]) -> list[int]:
    """Requests (other than /health) each replica served, from its /health headers."""

    async def ask() -> list[int]:
        client = ServerClient({})
        try:
            return [int((await client.get(url, "/health")).headers["x-rollgym-requests"]) for url in urls]
        finally:
            await client.close()

    return asyncio.run(ask())


def test_weather_with_three_replicas_collects_correct_rollouts(tmp_path: Path) -> None:
    """The commands of docs/deploy.md: `rollgym run ... weather.replicas=3`, then `collect-rollouts`."""
    tasks, output, registry_file = tmp_path / "tasks.jsonl", tmp_path / "rollouts.jsonl", tmp_path / "stack.json"
    tasks.write_text("".join(json.dumps(weather_row(*CITIES[i % len(CITIES)])) + "\n" for i in range(30)))
    with scripted_backend() as backend_url:
        process = start_rollgym(
            "run", str(WEATHER), str(CHAT), f"policy_model.base_url={backend_url}", "policy_model.model=scripted",
            "weather.replicas=3", "--registry-file", str(registry_file),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            deadline = time.monotonic() + 90
            while not registry_file.exists():
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline, "the stack did not start"
                time.sleep(0.05)
            time.sleep(0.1)
            urls = registry_from_json(json.loads(registry_file.read_text()))["weather"].urls
            assert len(urls) == 3 and len({urlparse(url).port for url in urls}) == 3
            result = subprocess.run(
                [sys.executable, "-m", "rollgym.cli", "collect-rollouts", "--registry-file", str(registry_file),
                 "--input", str(tasks), "--output", str(output), "--repeats", "2", "--concurrency", "12",
                 "--no-progress"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=180)
            assert result.returncode == 0, result.stderr
            served = replica_requests(urls)
        finally:
            stop_rollgym(process)
    rollouts = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rollouts) == 60 and len({r["rollout_id"] for r in rollouts}) == 60
    assert all(r["status"] == "ok" and r["reward"] == 1.0 for r in rollouts)
    assert all(r["looked_up"] == [r["city"]] for r in rollouts)  # each session's own state, on its own replica
    # seed + tool + verify per rollout, spread over all three replicas.
    assert sum(served) == 180 and min(served) >= 30, served


def listening_pid(port: int, parent: int) -> int:
    """The child of `parent` that listens on a loopback TCP port (read from /proc, Linux)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:  # LISTEN
            inodes.add(f"socket:[{fields[9]}]")
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                return int(entry.name)
        except OSError:
            continue
    raise LookupError(f"no child of {parent} listens on port {port}")


def test_a_session_outlives_its_replica_only_with_the_sqlite_store(tmp_path: Path) -> None:
    """`rollgym run` with a weather server on the SQLite store and one on the memory store, two
    replicas each: a session's replica is killed; the stack goes on, and so does the session whose
    state is shared; the other fails instead of going on with an empty state."""
    config_file, registry_file, log = tmp_path / "two_weathers.yaml", tmp_path / "stack.json", tmp_path / "run.log"
    config_file.write_text(
        "shared:\n  resources_servers:\n    weather:\n      replicas: 2\n      session_store: sqlite\n"
        "memory:\n  resources_servers:\n    weather:\n      replicas: 2\n"
    )
    with log.open("w") as output:
        process = start_rollgym("run", str(config_file), "--registry-file", str(registry_file),
                                stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not registry_file.exists():
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "the stack did not start"
            time.sleep(0.05)
        time.sleep(0.1)
        registry = registry_from_json(json.loads(registry_file.read_text()))
        assert registry["shared"].shared_sessions and not registry["memory"].shared_sessions

        async def scenario() -> None:
            client = ServerClient(registry, max_retries=1, backoff_base_s=0.001)
            try:
                row = weather_row("Paris", "sunny")
                cookies: dict[str, dict[str, str]] = {"shared": {}, "memory": {}}
                first = {}
                for name, jar in cookies.items():
                    await client.post(name, "/seed_session", json=row, cookies=jar)
                    reply = await client.post(name, "/get_weather", json={"city": "Paris"}, cookies=jar)
                    first[name] = int(reply.headers["x-rollgym-replica"])
                    port = urlparse(jar[REPLICA_KEY_PREFIX + name]).port
                    os.kill(listening_pid(port, process.pid), signal.SIGKILL)

                # The SQLite store: the session goes on on the other replica, with its state.
                reply = await client.post("shared", "/get_weather", json={"city": "London"}, cookies=cookies["shared"])
                assert reply.ok and int(reply.headers["x-rollgym-replica"]) == 1 - first["shared"]
                answer = [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                           "content": [{"type": "output_text", "text": "sunny", "annotations": []}]}]
                response = build_response(row["responses_create_params"], answer, model="m")
                verified = await client.post("shared", "/verify", json={**row, "response": response},
                                             cookies=cookies["shared"])
                assert verified.ok, verified.text
                assert verified.json()["looked_up"] == ["Paris", "London"] and verified.json()["reward"] == 1.0

                # The memory store: the state died with the replica, so the call fails (a rollout
                # would end as env_error and be retried), and new sessions go to the live replica.
                with pytest.raises(ServerCallError):
                    await client.post("memory", "/get_weather", json={"city": "London"}, cookies=cookies["memory"])
                fresh: dict[str, str] = {}
                reply = await client.post("memory", "/seed_session", json=row, cookies=fresh)
                assert reply.ok and int(reply.headers["x-rollgym-replica"]) == 1 - first["memory"]
            finally:
                await client.close()

        asyncio.run(scenario())
        time.sleep(0.5)
        assert process.poll() is None, "the stack stopped though every server has a replica left"
        text = log.read_text()
        for name in ("shared", "memory"):
            assert f"exited with code -9; 1 of 2 replicas of '{name}' left" in text, text
    finally:
        assert stop_rollgym(process) == 0, log.read_text()


def test_replicas_of_a_seeded_server_sample_with_seeds_of_their_own() -> None:
    """Replica i of the embedded model serves with seed + i: with one seed, two replicas answering a task's
    repeats at once would return the same rollout twice."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
    from rollgym.stack.serve import build_server

    spec = load_stack([REPO_ROOT / "models/llamacpp/configs/llamacpp.yaml"],
                      ["policy_model.seed=7", "policy_model.replicas=3"]).servers["policy_model"]
    seeds = [build_server(spec, {"registry": {}, "secret": "s" * 32}, replica).config.seed for replica in range(3)]
    assert seeds == [7, 8, 9]
