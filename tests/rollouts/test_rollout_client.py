"""RolloutClient: rollouts for trainers, grouped by task, with bounded retries and no made-up rewards.

Two kinds of agent: the real stack (scripted backend with token ids → chat_completions model →
simple_agent → reverse_text / weather, each a real HTTP server in a thread), and a scripted agent
whose `/run` fails on purpose (failure statuses, 5xx, 4xx, a hang) to test the retry bounds.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from aiohttp import web

from rollgym import RolloutClient, RolloutFailure, RolloutResult, RolloutsFailed
from rollgym.schema import RunResponse

REVERSE_SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."


def reverse_row(word: str, **extra: Any) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": REVERSE_SYSTEM},
                                                  {"role": "user", "content": f"Reverse this text: {word}"}]},
            "text": word, **extra}


def weather_row(city: str, expected: list[str]) -> dict[str, Any]:
    tool = {"type": "function", "name": "get_weather", "strict": False,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [tool]},
            "city": city, "expected": expected, "agent_ref": {"type": "agents", "name": "weather_agent"}}


# ---------------------------------------------------------------------------- a scripted agent


class ScriptedAgent:
    """A `/run` that answers per rollout_id from a script: fn(payload, attempt) -> (http status, body) or a delay."""

    def __init__(self, script: Callable[[dict[str, Any], int], Any]) -> None:
        self.script = script
        self.calls: Counter = Counter()
        self.payloads: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        payload = await request.json()
        rollout_id = payload["rollout_id"]
        self.calls[rollout_id] += 1
        self.payloads.append(payload)
        answer = self.script(payload, self.calls[rollout_id])
        if isinstance(answer, (int, float)):  # hang this long
            await asyncio.sleep(answer)
            answer = (200, ok_rollout(payload, 1.0))
        status, body = answer
        return web.json_response(body, status=status)


def ok_rollout(payload: dict[str, Any], reward: float, status: str = "ok") -> dict[str, Any]:
    return {**payload, "response": None, "reward": reward, "status": status, "error": None,
            "metrics": {"turns": 1}, "rollout_id": "the agent's own", "group_id": "the agent's own"}


def failed_rollout(payload: dict[str, Any], status: str) -> dict[str, Any]:
    return {**payload, "response": None, "reward": None, "status": status, "error": f"{status} on purpose"}


@contextmanager
def serve_scripted(agent: ScriptedAgent) -> Iterator[str]:
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    app = web.Application()
    app.router.add_post("/run", agent.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.2)
    started = threading.Event()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.SockSite(runner, sock).start())
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        sock.close()


def fast_client(url: str, **kwargs: Any) -> RolloutClient:
    kwargs.setdefault("retry_backoff_s", 0.01)
    kwargs.setdefault("http_retries", 0)
    return RolloutClient(url, **kwargs)


# ---------------------------------------------------------------------------- the real stack


def test_groups_follow_input_order_with_stamped_ids(scripted_agents) -> None:
    rows = [reverse_row("bridge"), reverse_row("puzzle", group_id="mine"), reverse_row("jumps")]
    with RolloutClient(scripted_agents, agent="reverse_text_agent", max_attempts=1) as client:
        groups = client.run_sync(rows, repeats=3, concurrency=4)
    assert [len(group) for group in groups] == [3, 3, 3]
    for row, group in zip(rows, groups):
        group_ids = {rollout["group_id"] for rollout in group}
        assert len(group_ids) == 1
        group_id = group_ids.pop()
        assert [rollout["rollout_id"] for rollout in group] == [f"{group_id}-r{k}" for k in range(3)]
        for rollout in group:
            RunResponse.model_validate(rollout)
            assert rollout["text"] == row["text"]
            assert rollout["status"] == "ok" and rollout["reward"] == 1.0  # the scripted model reverses exactly
            sequence = rollout["sequences"][0]
            lengths = {len(sequence[key]) for key in ("completion_ids", "completion_mask", "completion_logprobs")}
            assert len(lengths) == 1
    assert groups[1][0]["group_id"] == "mine"  # a row's own group_id is kept
    assert groups[0][0]["group_id"].startswith("L000001-") and groups[2][0]["group_id"].startswith("L000003-")


def test_rows_route_by_agent_ref_and_repeats_per_row(scripted_agents, tmp_path: Path) -> None:
    registry_file = tmp_path / "registry.json"
    registry_file.write_text(json.dumps({name: address.to_json() for name, address in scripted_agents.items()}))
    rows = [weather_row("Paris", ["sunny", "22"]), reverse_row("cat"), weather_row("Oslo", ["sunny"])]
    client = RolloutClient(str(registry_file), agent="reverse_text_agent", params={"temperature": 0.5})
    try:
        groups = client.run_sync(rows, repeats=[1, 2, 3])
    finally:
        client.close()
    assert [len(group) for group in groups] == [1, 2, 3]
    assert groups[0][0]["reward"] == 1.0 and groups[0][0]["metrics"]["tool_calls"] == 1  # the weather agent ran it
    assert groups[1][0]["text"] == "cat" and groups[1][0]["responses_create_params"]["temperature"] == 0.5
    assert [rollout["reward"] for rollout in groups[2]] == [0.0, 0.0, 0.0]  # a real 0.0: Oslo is snowy


async def test_await_run_from_async_code(scripted_agents) -> None:
    async with RolloutClient(scripted_agents["reverse_text_agent"].url) as client:
        groups, more = await asyncio.gather(client.run([reverse_row("ab")], repeats=2),
                                            client.run([reverse_row("cd"), reverse_row("ef")]))
        assert [r["reward"] for r in groups[0]] == [1.0, 1.0]
        assert [g[0]["text"] for g in more] == ["cd", "ef"]
        # run_sync from a thread that runs an event loop works too: it blocks that loop meanwhile.
        assert client.run_sync([reverse_row("gh")])[0][0]["reward"] == 1.0


def test_run_sync_repeatedly_and_after_close(scripted_agents) -> None:
    client = RolloutClient(scripted_agents["reverse_text_agent"].url)
    for word in ("one", "two", "three"):
        assert client.run_sync([reverse_row(word)])[0][0]["text"] == word
    client.close()
    assert client.run_sync([reverse_row("again")])[0][0]["reward"] == 1.0  # a new private loop starts
    client.close()
    client.close()  # idempotent


def test_run_sync_from_many_threads_at_once(scripted_agents) -> None:
    with RolloutClient(scripted_agents["reverse_text_agent"].url) as client:
        results: dict[int, Any] = {}

        def work(index: int) -> None:
            results[index] = client.run_sync([reverse_row(f"w{index}")], repeats=2)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(results[i][0][0]["text"] == f"w{i}" for i in range(4))


# ---------------------------------------------------------------------------- retries and failures


def test_infrastructure_failures_are_retried_then_succeed() -> None:
    statuses = ["model_error", "env_error", "timeout"]

    def script(payload: dict[str, Any], attempt: int) -> Any:
        if attempt <= 2:  # two failures of each kind, then the real rollout
            return 200, failed_rollout(payload, statuses[attempt % 3])
        return 200, ok_rollout(payload, 0.25)

    agent = ScriptedAgent(script)
    with serve_scripted(agent) as url, fast_client(url, max_attempts=3) as client:
        groups = client.run_sync([reverse_row("a"), reverse_row("b")], repeats=2)
    assert [[r["reward"] for r in group] for group in groups] == [[0.25, 0.25], [0.25, 0.25]]
    assert set(agent.calls.values()) == {3}
    # The client stamps its own ids over whatever the agent answered.
    assert groups[1][1]["rollout_id"] == groups[1][1]["group_id"] + "-r1"


def test_a_rollout_that_never_succeeds_raises_and_is_never_a_zero_reward() -> None:
    def script(payload: dict[str, Any], attempt: int) -> Any:
        if payload["text"] == "bad" and payload["rollout_id"].endswith("-r1"):
            return 200, failed_rollout(payload, "env_error")
        return 200, ok_rollout(payload, 1.0)

    agent = ScriptedAgent(script)
    rows = [reverse_row("good"), reverse_row("bad")]
    with serve_scripted(agent) as url, fast_client(url, max_attempts=4) as client:
        with pytest.raises(RolloutsFailed) as caught:
            client.run_sync(rows, repeats=2)
        detailed = client.run_detailed_sync(rows, repeats=2)
    error = caught.value
    assert "1 of 4 rollouts failed after retries (env_error 1)" in str(error)
    assert error.failures == detailed.failures
    [failure] = detailed.failures
    assert isinstance(failure, RolloutFailure)
    assert (failure.index, failure.repeat, failure.status, failure.attempts) == (1, 1, "env_error", 4)
    assert failure.error == "env_error on purpose" and failure.rollout_id == failure.group_id + "-r1"
    # The failed slot is absent, not a reward of 0.
    assert [len(group) for group in error.groups] == [2, 1] == [len(group) for group in detailed.groups]
    assert isinstance(detailed, RolloutResult) and not detailed.ok
    assert detailed.get(1, 1) is None and detailed.get(1, 0)["reward"] == 1.0
    assert all(r["reward"] == 1.0 for group in detailed.groups for r in group)


def test_http_5xx_is_retried_and_4xx_is_not() -> None:
    def script(payload: dict[str, Any], attempt: int) -> Any:
        if payload["text"] == "flaky" and attempt == 1:
            return 503, {"error": {"message": "busy"}}
        if payload["text"] == "rejected":
            return 422, {"error": {"type": "invalid_request", "field": "text", "message": "no such word"}}
        return 200, ok_rollout(payload, 0.5)

    agent = ScriptedAgent(script)
    with serve_scripted(agent) as url, fast_client(url, max_attempts=3) as client:
        result = client.run_detailed_sync([reverse_row("flaky"), reverse_row("rejected")])
    assert result.groups[0][0]["reward"] == 0.5
    [failure] = result.failures
    assert failure.status == "rejected" and failure.attempts == 1 and "HTTP 422: no such word" in failure.error
    assert sorted(agent.calls.values()) == [1, 2]


def test_a_hanging_rollout_times_out_within_bounds() -> None:
    agent = ScriptedAgent(lambda payload, attempt: 5.0)
    with serve_scripted(agent) as url, fast_client(url, timeout_s=0.3, max_attempts=2) as client:
        started = time.monotonic()
        result = client.run_detailed_sync([reverse_row("slow")])
        assert time.monotonic() - started < 3
    assert [f.status for f in result.failures] == ["timeout"] and result.failures[0].attempts == 2


def test_the_rollout_budget_bounds_all_attempts_together() -> None:
    # Every attempt hangs; --max-attempts alone would allow 100 × 0.5 s, the budget allows 1 s in all.
    agent = ScriptedAgent(lambda payload, attempt: 5.0)
    with serve_scripted(agent) as url, fast_client(url, timeout_s=0.5, max_attempts=100, rollout_budget_s=1.0) as client:
        started = time.monotonic()
        result = client.run_detailed_sync([reverse_row("slow")])
        assert time.monotonic() - started < 3
    [failure] = result.failures
    assert failure.status == "timeout" and 2 <= failure.attempts <= 3 and not result.groups[0]
    with pytest.raises(ValueError, match="rollout_budget_s must be positive"):
        RolloutClient(url, rollout_budget_s=0)


def test_an_unreachable_agent_is_an_agent_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with fast_client(f"http://127.0.0.1:{port}", max_attempts=2) as client:
        with pytest.raises(RolloutsFailed, match="agent_error 1"):
            client.run_sync([reverse_row("x")])


def test_bad_rows_are_refused_before_anything_is_sent() -> None:
    agent = ScriptedAgent(lambda payload, attempt: (200, ok_rollout(payload, 1.0)))
    with serve_scripted(agent) as url, fast_client(url) as client:
        with pytest.raises(ValueError, match=r"rows\[1\]: field 'responses_create_params"):
            client.run_sync([reverse_row("a"), {"text": "no params"}])
        with pytest.raises(ValueError, match="repeats has 1 counts for 2 rows"):
            client.run_sync([reverse_row("a"), reverse_row("b")], repeats=[2])
        with pytest.raises(TypeError):
            client.run_sync(reverse_row("a"))
    assert not agent.calls


def test_registry_needs_an_agent_when_it_has_several(scripted_agents) -> None:
    with pytest.raises(ValueError, match="not in the registry"):
        RolloutClient(scripted_agents, agent="nobody")
    with RolloutClient(scripted_agents) as client:  # two agents: rows must name theirs
        with pytest.raises(ValueError, match=r"rows\[0\] names no agent .* pass agent="):
            client.run_sync([reverse_row("a")])
        with pytest.raises(ValueError, match=r"rows\[1\]: agent_ref names agent 'nemo_agent', which this stack does"):
            client.run_sync([reverse_row("a", agent_ref="reverse_text_agent"), reverse_row("b", agent_ref="nemo_agent")])
        groups = client.run_sync([reverse_row("a", agent_ref={"type": "agents", "name": "reverse_text_agent"})])
    assert groups[0][0]["reward"] == 1.0
    with pytest.raises(ValueError, match="neither an http"):
        RolloutClient("no/such/registry.json")


def test_run_sync_inside_the_private_loop_is_refused() -> None:
    agent = ScriptedAgent(lambda payload, attempt: (200, ok_rollout(payload, 1.0)))
    with serve_scripted(agent) as url, fast_client(url) as client:
        client.run_sync([reverse_row("warm")])
        runner, _ = client._ensure_runner()

        async def nested() -> None:
            client.run_sync([reverse_row("x")])

        with pytest.raises(RuntimeError, match="own event loop"):
            runner.submit(nested()).result(10)
