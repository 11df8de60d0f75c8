"""ServerClient against real flaky aiohttp servers on loopback: retries, timeouts, cookies."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from rollgym import ServerAddress, ServerCallError, ServerClient
from rollgym.testing import free_port


async def start(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def flaky_app(fail_first: int, status: int) -> tuple[web.Application, dict]:
    """Answers `status` to the first `fail_first` requests, then 200 with the attempt number."""
    seen = {"count": 0}

    async def handler(request: web.Request) -> web.Response:
        seen["count"] += 1
        if seen["count"] <= fail_first:
            return web.json_response({"error": {"message": f"try {seen['count']} failed"}}, status=status)
        return web.json_response({"attempt": seen["count"], "echo": await request.json()})

    app = web.Application()
    app.router.add_post("/work", handler)
    return app, seen


@pytest.mark.parametrize("status", [429, 500, 503])
async def test_retries_retryable_statuses_then_succeeds(status: int) -> None:
    app, seen = flaky_app(fail_first=2, status=status)
    runner, url = await start(app)
    client = ServerClient({"svc": ServerAddress(url)}, max_retries=3, backoff_base_s=0.001)
    try:
        reply = await client.post("svc", "/work", json={"x": 1})
        assert reply.ok and reply.json() == {"attempt": 3, "echo": {"x": 1}}
        assert seen["count"] == 3
    finally:
        await client.close()
        await runner.cleanup()


async def test_retries_are_bounded() -> None:
    app, seen = flaky_app(fail_first=100, status=503)
    runner, url = await start(app)
    client = ServerClient({"svc": ServerAddress(url)}, max_retries=2, backoff_base_s=0.001)
    try:
        reply = await client.post("svc", "/work", json={})
        assert reply.status == 503
        assert reply.error_message() == "try 3 failed"
        assert seen["count"] == 3  # one try and two retries, never more
    finally:
        await client.close()
        await runner.cleanup()


async def test_client_errors_are_not_retried() -> None:
    app, seen = flaky_app(fail_first=100, status=422)
    runner, url = await start(app)
    client = ServerClient({"svc": ServerAddress(url)}, max_retries=3, backoff_base_s=0.001)
    try:
        reply = await client.post("svc", "/work", json={})
        assert reply.status == 422 and seen["count"] == 1
    finally:
        await client.close()
        await runner.cleanup()


async def test_connection_refused_raises_after_bounded_retries() -> None:
    client = ServerClient({"gone": ServerAddress(f"http://127.0.0.1:{free_port()}")}, max_retries=2, backoff_base_s=0.001)
    try:
        with pytest.raises(ServerCallError) as info:
            await client.post("gone", "/x", json={})
        assert info.value.kind == "connect" and info.value.server == "gone"
    finally:
        await client.close()


async def test_an_answer_cut_off_mid_body_is_a_call_error_retried_like_a_lost_connection() -> None:
    """A server that dies while sending its answer (headers out, body cut short) is a failed call with
    its cause, as a refused connection is: never an exception the caller did not expect."""
    calls = {"count": 0}

    async def cut(request: web.Request) -> web.StreamResponse:
        calls["count"] += 1
        response = web.StreamResponse(headers={"Content-Length": "100", "Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"partial": ')
        assert request.transport is not None
        request.transport.close()
        return response

    app = web.Application()
    app.router.add_post("/cut", cut)
    runner, url = await start(app)
    client = ServerClient({"svc": ServerAddress(url)}, max_retries=1, backoff_base_s=0.001)
    try:
        with pytest.raises(ServerCallError) as info:
            await client.post("svc", "/cut", json={})
        assert info.value.kind == "connect" and "ClientPayloadError" in str(info.value)
        assert calls["count"] == 2  # one try and one retry
    finally:
        await client.close()
        await runner.cleanup()


async def test_timeout_is_reported_and_not_retried() -> None:
    calls = {"count": 0}

    async def hang(request: web.Request) -> web.Response:
        calls["count"] += 1
        await asyncio.sleep(30)
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/slow", hang)
    runner, url = await start(app)
    client = ServerClient({"svc": ServerAddress(url)}, max_retries=3)
    try:
        started = time.monotonic()
        with pytest.raises(ServerCallError) as info:
            await client.post("svc", "/slow", json={}, timeout_s=0.3)
        assert info.value.kind == "timeout"
        assert time.monotonic() - started < 2.0
        assert calls["count"] == 1
    finally:
        await client.close()
        await runner.cleanup()


async def test_cookies_are_kept_per_caller_dict() -> None:
    async def session(request: web.Request) -> web.Response:
        response = web.json_response({"cookie": request.cookies.get("sid")})
        if "sid" not in request.cookies:
            response.set_cookie("sid", request.query["new"])
        return response

    app = web.Application()
    app.router.add_post("/s", session)
    runner, url = await start(app)
    client = ServerClient({"svc": ServerAddress(url)})
    try:
        first, second = {}, {}
        assert (await client.post("svc", "/s?new=a", json={}, cookies=first)).json() == {"cookie": None}
        assert (await client.post("svc", "/s?new=b", json={}, cookies=second)).json() == {"cookie": None}
        assert first == {"sid": "a"} and second == {"sid": "b"}
        assert (await client.post("svc", "/s", json={}, cookies=first)).json() == {"cookie": "a"}
        assert (await client.post("svc", "/s", json={}, cookies=second)).json() == {"cookie": "b"}
        # A call without a cookie dict carries no cookie: the pooled session keeps no shared jar.
        assert (await client.post("svc", "/s?new=c", json={})).json() == {"cookie": None}
    finally:
        await client.close()
        await runner.cleanup()


async def test_bearer_token_from_registry_and_unknown_names() -> None:
    async def whoami(request: web.Request) -> web.Response:
        return web.json_response({"auth": request.headers.get("Authorization")})

    app = web.Application()
    app.router.add_get("/me", whoami)
    runner, url = await start(app)
    client = ServerClient({"svc": ServerAddress(url, auth_token="s3cret")})
    try:
        assert (await client.get("svc", "/me")).json() == {"auth": "Bearer s3cret"}
        with pytest.raises(ServerCallError, match="no server named 'nope'"):
            await client.get("nope", "/me")
    finally:
        await client.close()
        await runner.cleanup()


def test_no_call_without_a_timeout() -> None:
    with pytest.raises(ValueError):
        ServerClient({}, timeout_s=0)
