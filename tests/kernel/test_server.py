"""The server base: health, structured errors, body limit, auth and signed sessions."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from rollgym import ResourcesServer, ServerConfig, tool
from rollgym.resources import ResourcesServerConfig


class CounterArgs(BaseModel):
    amount: int


class Crash(BaseModel):
    pass


class CounterServer(ResourcesServer):
    """A stateful test environment: a per-session counter, and a tool that crashes."""

    @tool
    async def add(self, args: CounterArgs, state: dict[str, Any]) -> dict[str, int]:
        """Add to the counter."""
        state["total"] = state.get("total", 0) + args.amount
        return {"total": state["total"]}

    @tool
    async def explode(self, args: Crash, state: dict[str, Any]) -> str:
        raise RuntimeError("secret internals /etc/passwd")

    async def verify(self, request: Any, state: dict[str, Any]) -> float:
        return float(state.get("total", 0))


def client_for(server: ResourcesServer) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=server.build_app(), raise_app_exceptions=False),
                             base_url="http://test")


async def test_health_and_tool_schemas() -> None:
    async with client_for(CounterServer(name="counter")) as http:
        health = await http.get("/health")
        assert health.json() == {"status": "ok", "name": "counter", "role": "resources_servers"}
        tools = (await http.get("/tools")).json()
        add = next(t for t in tools if t["name"] == "add")
        assert add == {"type": "function", "name": "add", "description": "Add to the counter.", "strict": False,
                       "parameters": {"type": "object", "properties": {"amount": {"type": "integer"}},
                                      "required": ["amount"], "additionalProperties": False}}


async def test_state_is_per_session_and_a_forged_cookie_is_a_new_session() -> None:
    async with client_for(CounterServer()) as first, client_for(CounterServer()) as unused:
        del unused
        assert (await first.post("/add", json={"amount": 2})).json() == {"total": 2}
        assert (await first.post("/add", json={"amount": 3})).json() == {"total": 5}
        cookie = first.cookies.get("rollgym_session")
        session_id = cookie.split(".")[0]
        # Same server, another client with a forged signature: it must not see the total.
        app = first._transport.app  # the same app instance, so the same session store
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as forger:
            forged = await forger.post("/add", json={"amount": 1},
                                       headers={"Cookie": f"rollgym_session={session_id}.{'0' * 32}"})
            assert forged.json() == {"total": 1}
            new_cookie = forged.headers["set-cookie"].split(";")[0].split("=", 1)[1]
            assert new_cookie.split(".")[0] != session_id


async def test_validation_errors_name_the_field() -> None:
    async with client_for(CounterServer()) as http:
        reply = await http.post("/add", json={"amount": "lots"})
        assert reply.status_code == 422
        error = reply.json()["error"]
        assert error["type"] == "invalid_request" and error["field"] == "amount"
        assert error["message"].startswith("field 'amount': Input should be a valid integer")
        missing = (await http.post("/add", json={})).json()["error"]
        assert missing["field"] == "amount" and "Field required" in missing["message"]


async def test_malformed_and_empty_bodies_are_400() -> None:
    async with client_for(CounterServer()) as http:
        reply = await http.post("/add", content=b"{not json", headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]
        empty = await http.post("/add")
        assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]


async def test_seed_and_verify_validate_the_task_row() -> None:
    async with client_for(CounterServer()) as http:
        reply = await http.post("/seed_session", json={"responses_create_params": {"input": 7}})
        assert reply.status_code == 422 and reply.json()["error"]["field"] == "responses_create_params.input"
        reply = await http.post("/verify", json={"responses_create_params": {"input": "hi"}})
        assert reply.status_code == 422 and reply.json()["error"]["field"] == "response"


async def test_unknown_route_and_crash_are_structured_without_trace() -> None:
    async with client_for(CounterServer()) as http:
        missing = await http.post("/no_such_tool", json={})
        assert missing.status_code == 404
        assert missing.json() == {"error": {"type": "not_found", "message": "no route POST /no_such_tool"}}
        crash = await http.post("/explode", json={})
        assert crash.status_code == 500
        body = crash.json()
        assert body["error"]["type"] == "internal_error"
        assert body["error"]["message"] == "RuntimeError: secret internals /etc/passwd"
        assert "Traceback" not in crash.text


async def test_busy_routes_are_served_directly_and_every_other_route_through_fastapi() -> None:
    app = CounterServer(name="counter").build_app()

    @app.get("/echo")  # a query parameter for FastAPI to parse and validate: not served directly
    async def echo(word: str) -> dict[str, str]:
        return {"word": word}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        assert (await http.post("/add", json={"amount": 2})).json() == {"total": 2}
        assert sorted(app.hot_paths()) == ["/add", "/explode", "/seed_session", "/tools", "/verify"]
        assert (await http.get("/echo", params={"word": "hi"})).json() == {"word": "hi"}
        assert (await http.get("/echo")).json()["error"]["field"] == "query.word"
        wrong_method = await http.get("/add")
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "method_not_allowed"
        assert {"/add", "/seed_session", "/verify", "/echo"} <= set((await http.get("/openapi.json")).json()["paths"])


async def test_body_limit() -> None:
    server = CounterServer(ResourcesServerConfig(max_body_bytes=100))
    async with client_for(server) as http:
        reply = await http.post("/add", content=b'{"amount": 1, "pad": "' + b"x" * 200 + b'"}',
                                headers={"content-type": "application/json"})
        assert reply.status_code == 413 and reply.json()["error"]["type"] == "payload_too_large"
        assert (await http.post("/add", json={"amount": 1})).status_code == 200


async def test_bearer_auth_guards_everything_but_health() -> None:
    server = CounterServer(ResourcesServerConfig(auth_token="tok"))
    async with client_for(server) as http:
        assert (await http.get("/health")).status_code == 200
        assert (await http.post("/add", json={"amount": 1})).status_code == 401
        assert (await http.post("/add", json={"amount": 1}, headers={"Authorization": "Bearer nope"})).status_code == 401
        ok = await http.post("/add", json={"amount": 1}, headers={"Authorization": "Bearer tok"})
        assert ok.json() == {"total": 1}


def test_binding_beyond_loopback_without_token_refuses_to_start() -> None:
    from rollgym.server import ServerStartError

    with pytest.raises(ServerStartError):
        CounterServer(ResourcesServerConfig(host="0.0.0.0"))
    assert CounterServer(ResourcesServerConfig(host="::1")).config.host == "::1"


def test_plain_server_config_forbids_unknown_options() -> None:
    with pytest.raises(Exception, match="colour"):
        ServerConfig.model_validate({"colour": "blue"})



def test_an_environment_kept_outside_the_checkout_imports_without_an_init_file(tmp_path, monkeypatch) -> None:
    """A user's ENVS/resources_servers/capital/ (no __init__.py anywhere), loaded after the checkout's own
    resources_servers package was imported: its server class loads (it failed with
    `No module named 'resources_servers.capital'`)."""
    import shutil
    import sys

    import resources_servers

    from rollgym.config import load_stack
    from rollgym.server import load_server_class
    from rollgym.testing import REPO_ROOT

    folder = tmp_path / "envs" / "resources_servers" / "capital"
    shutil.copytree(REPO_ROOT / "resources_servers" / "weather", folder,
                    ignore=shutil.ignore_patterns("__init__.py", "__pycache__", "tests", "data"))
    config = folder / "configs" / "capital.yaml"
    config.write_text("capital:\n  resources_servers:\n    capital:\n      entrypoint: app.py\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # what loading adds is taken back after the test
    monkeypatch.setattr(resources_servers, "__path__", list(resources_servers.__path__))
    try:
        spec = load_stack([config], add_default_model=False).servers["capital"]
        server = load_server_class(spec)
        assert server.__name__ == "WeatherServer" and server.__module__ == "resources_servers.capital.app"
        assert sys.modules["resources_servers.capital.app"].__file__ == str(folder / "app.py")
    finally:
        for name in [name for name in sys.modules if name.startswith("resources_servers.capital")]:
            del sys.modules[name]
