"""mcp: a real MCP server process (tests/notes_server.py) as an environment's tools, over stdio
(one server process per rollout session) and over streamable HTTP."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from resources_servers.mcp.app import McpConfig, McpEnvironment
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, free_port, serve_in_thread

pytest.importorskip("mcp", reason="the MCP environment needs the mcp package (the 'agents' extra)")

ENV = env_folder(__file__)
NOTES_SERVER = Path(__file__).with_name("notes_server.py")
VERIFY = "resources_servers.mcp.tests.notes_server:verify"


def row(note: str) -> dict:
    return {"responses_create_params": {"input": f"Write a note saying {note!r}."}, "note": note}


def verify(http: httpx.Client, note: str) -> httpx.Response:
    return http.post("/verify", json={**row(note), "response": final_response("done")})


@pytest.fixture(scope="module")
def stdio_url() -> Iterator[str]:
    """The folder's own config: the notebook server started per rollout over stdio."""
    with serve_in_thread(ENV.build("mcp_notes", f"mcp_notes.command=[python,{NOTES_SERVER}]"), timeout_s=60) as url:
        yield url


def test_the_example_rows_are_for_the_notebook() -> None:
    rows = ENV.rows()
    assert len(rows) == 5 and all(row["note"] in row["responses_create_params"]["input"][-1]["content"] for row in rows)


def test_the_mcp_servers_tools_are_the_environments_tools(stdio_url: str) -> None:
    tools = {tool["name"]: tool for tool in httpx.get(f"{stdio_url}/tools").json()}
    assert set(tools) == {"add_note", "list_notes"}
    assert tools["add_note"]["type"] == "function" and tools["add_note"]["description"] == "Write a note."
    assert tools["add_note"]["parameters"]["required"] == ["text"]


def test_each_rollout_session_has_its_own_mcp_session(stdio_url: str) -> None:
    with httpx.Client(base_url=stdio_url, timeout=60) as a, httpx.Client(base_url=stdio_url, timeout=60) as b:
        assert a.post("/seed_session", json=row("alpha")).status_code == 200
        assert b.post("/seed_session", json=row("beta")).status_code == 200
        assert a.post("/add_note", json={"text": "alpha"}).text == "noted (1 notes)"
        assert b.post("/list_notes", json={}).text == "(no notes)"  # another process, another notebook
        assert a.post("/list_notes", json={}).text == "alpha"
        assert verify(a, "alpha").json()["reward"] == 1.0
        assert verify(b, "beta").json()["reward"] == 0.0
        after = a.post("/list_notes", json={})  # verify closed the rollout's MCP session
        assert after.status_code == 409 and after.json()["error"]["field"] == "session"


def test_bad_tool_calls_say_what_is_wrong(stdio_url: str) -> None:
    with httpx.Client(base_url=stdio_url, timeout=60) as http:
        http.post("/seed_session", json=row("x"))
        assert http.post("/nope", json={}).status_code == 404
        assert http.post("/add_note", json=[1]).json()["error"]["field"] == "body"
        missing = http.post("/add_note", json={})  # the MCP server's own validation, for the model to read
        assert missing.status_code == 200 and missing.text.startswith("Error:") and "text" in missing.text
        verify(http, "x")


def test_streamable_http_mcp_server() -> None:
    port = free_port()
    process = subprocess.Popen([sys.executable, str(NOTES_SERVER), "--http", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/mcp", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "the MCP server did not start"
                time.sleep(0.1)
        config = McpConfig(url=f"http://127.0.0.1:{port}/mcp", verify=VERIFY)
        with serve_in_thread(McpEnvironment(config, name="mcp"), timeout_s=60) as url, \
                httpx.Client(base_url=url, timeout=60) as http:
            assert {tool["name"] for tool in http.get("/tools").json()} == {"add_note", "list_notes"}
            http.post("/seed_session", json=row("gamma"))
            assert http.post("/add_note", json={"text": "gamma"}).text.startswith("noted")
            assert verify(http, "gamma").json()["reward"] == 1.0
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_a_config_needs_exactly_one_transport() -> None:
    with pytest.raises(ValueError, match="exactly one of command"):
        McpConfig(verify=VERIFY)
    with pytest.raises(ValueError, match="exactly one of command"):
        McpConfig(command=["x"], url="http://127.0.0.1:1/mcp", verify=VERIFY)
