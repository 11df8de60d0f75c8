"""Benchmark: what the proxy agent adds to each model call of an external agent.

    .venv/bin/python scripts/bench_proxy.py [--rollouts 200] [--concurrency 16] [--calls 1,8]

A stack of chat_completions (in front of the scripted backend, vLLM's stand-in, with token ids),
weather and proxy_agent is started with `rollgym.Stack` (one process per server). The external agent
is an HTTP workflow in this process (`agent: {kind: http}`): for each rollout it makes K chat calls
on its per-rollout base URL, each call's conversation extending the previous one (so every call goes
through token restoration). The same K-call loop is also run straight against the model server.

Reported:
- added latency per model call: median (and p90) of a call through the proxy minus a direct call,
  at the given concurrency;
- proxy CPU per model call: the proxy process's CPU seconds, as the slope between the runs with the
  fewest and the most calls per rollout (so /run, /seed_session and /verify are not counted in it),
  and the proxy's CPU per rollout at each K.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rollgym import Stack, load_stack  # noqa: E402
from rollgym.testing import free_port, scripted_backend  # noqa: E402

LATENCIES: dict[str, list[float]] = {"direct": [], "proxy": []}


async def k_calls(http: aiohttp.ClientSession, base_url: str, key: str, calls: int, mode: str) -> str:
    """The agent's loop: `calls` chat calls, each extending the conversation before it."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Say something."}]
    answer = ""
    for turn in range(calls):
        started = time.perf_counter()
        async with http.post(f"{base_url}/chat/completions", headers={"Authorization": f"Bearer {key}"},
                             json={"model": "m", "messages": messages, "max_tokens": 16}) as reply:
            body = await reply.json()
            assert reply.status == 200, body
        LATENCIES[mode].append(time.perf_counter() - started)
        answer = body["choices"][0]["message"]["content"] or ""
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And then? ({turn})"}]
    return answer


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def drive(args: argparse.Namespace, registry: dict, proxy_pid: int, workflow_port: int) -> dict[str, Any]:
    state = {"calls": 1}
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def workflow(request: web.Request) -> web.Response:
        body = await request.json()
        answer = await k_calls(http, body["base_url"], body["api_key"], state["calls"], "proxy")
        return web.json_response({"answer": answer})

    app = web.Application()
    app.router.add_post("/run", workflow)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", workflow_port).start()
    proxy = psutil.Process(proxy_pid)
    model_v1 = registry["policy_model"].url + "/v1"
    agent_url = registry["proxy_agent"].url
    row = {"responses_create_params": {"input": "What is the weather in Paris?"}, "city": "Paris",
           "expected": ["sunny"]}
    gate = asyncio.Semaphore(args.concurrency)
    results: dict[str, Any] = {"cpu_ms_per_rollout": {}}

    async def one_run() -> None:
        async with gate, http.post(f"{agent_url}/run", json=row) as reply:
            body = await reply.json()
            assert body.get("status") == "ok", body.get("error")

    async def one_direct(calls: int) -> None:
        async with gate:
            await k_calls(http, model_v1, "unused", calls, "direct")

    cpu_at: dict[int, float] = {}
    for calls in args.calls:
        state["calls"] = calls
        await asyncio.gather(*(one_run() for _ in range(args.warmup)))
        LATENCIES["proxy"].clear()
        before = sum(proxy.cpu_times()[:2])
        await asyncio.gather(*(one_run() for _ in range(args.rollouts)))
        cpu = sum(proxy.cpu_times()[:2]) - before
        cpu_at[calls] = cpu
        results["cpu_ms_per_rollout"][calls] = round(cpu * 1000 / args.rollouts, 3)
    proxied = list(LATENCIES["proxy"])
    await asyncio.gather(*(one_direct(args.calls[-1]) for _ in range(args.rollouts)))
    direct = LATENCIES["direct"]
    low, high = min(args.calls), max(args.calls)
    if high > low:
        results["proxy_cpu_ms_per_model_call"] = round((cpu_at[high] - cpu_at[low]) * 1000 / (args.rollouts * (high - low)), 3)
    results["direct_call_ms_p50"] = round(statistics.median(direct) * 1000, 3)
    results["proxied_call_ms_p50"] = round(statistics.median(proxied) * 1000, 3)
    results["added_latency_ms_p50"] = round((statistics.median(proxied) - statistics.median(direct)) * 1000, 3)
    results["added_latency_ms_p90"] = round((percentile(proxied, 0.9) - percentile(direct, 0.9)) * 1000, 3)
    await http.close()
    await runner.cleanup()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--calls", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8],
                        help="model calls per rollout, comma-separated (the CPU slope uses the first and last)")
    args = parser.parse_args()
    os.chdir(Path(__file__).resolve().parents[1])
    workflow_port = free_port()
    with scripted_backend("--token-info") as backend, tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "stack.yaml"
        config.write_text(json.dumps({
            "policy_model": {"models": {"chat_completions": {
                "entrypoint": "app.py", "base_url": backend, "model": "scripted", "return_token_ids": True}}},
            "weather": {"resources_servers": {"weather": {"entrypoint": "app.py"}}},
            "proxy_agent": {"agents": {"proxy_agent": {
                "entrypoint": "app.py", "model_server": {"name": "policy_model"},
                "resources_server": {"name": "weather"}, "max_model_calls": 64,
                "agent": {"kind": "http", "url": f"http://127.0.0.1:{workflow_port}/run"}}}},
        }))
        stack = Stack(load_stack([config], []))  # server folders are found from the cwd: the repository root
        registry = stack.start(timeout_s=120)
        try:
            proxy_pid = next(p.pid for name, p in stack.processes.items() if name.startswith("proxy_agent"))
            print(f"proxy agent pid {proxy_pid}", file=sys.stderr, flush=True)
            results = asyncio.run(drive(args, registry, proxy_pid, workflow_port))
        finally:
            stack.stop()
    print(json.dumps({"rollouts": args.rollouts, "concurrency": args.concurrency, "calls": args.calls, **results},
                     indent=2))


if __name__ == "__main__":
    main()
