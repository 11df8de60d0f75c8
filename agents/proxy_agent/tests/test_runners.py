"""The http workflow runner: one pooled session serves every rollout, with no cap on the calls in flight."""

from __future__ import annotations

import asyncio

from aiohttp import web

from agents.proxy_agent.runners import Endpoint, HttpRunner

IN_FLIGHT = 120  # past aiohttp's default of 100 connections per session


async def test_more_workflow_calls_than_a_default_pool_run_at_once() -> None:
    arrived = 0
    everyone = asyncio.Event()

    async def workflow(request: web.Request) -> web.Response:
        nonlocal arrived
        body = await request.json()
        arrived += 1
        if arrived == IN_FLIGHT:
            everyone.set()
        await everyone.wait()  # answers only once every call is in flight at the same time
        return web.json_response({"answer": body["task"]["n"], "score": 1.0})

    app = web.Application()
    app.router.add_post("/workflow", workflow)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    http_runner = HttpRunner(kind="http", url=f"http://127.0.0.1:{port}/workflow")
    endpoint = Endpoint(base_url="http://x/v1", api_key="k", tools_url="http://x/tools", model="m", rollout_id="r")
    try:
        outcomes = await asyncio.wait_for(asyncio.gather(
            *(http_runner.run({"n": n}, endpoint, timeout_s=30) for n in range(IN_FLIGHT))), 20)
        assert [outcome.answer for outcome in outcomes] == [str(n) for n in range(IN_FLIGHT)]
    finally:
        await http_runner.close()
        await runner.cleanup()
