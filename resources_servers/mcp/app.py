"""mcp: any MCP server's tools as an environment's tools.

The server starts an MCP server as a subprocess (stdio, `command`) or connects to one (streamable
HTTP, `url`), lists its tools on `GET /tools` as Responses function tools, and serves each as
`POST /{tool}`. Every rollout session gets its own MCP client session (over stdio: its own server
process), opened by `/seed_session` and closed by `/verify`, so one rollout's tool state never
reaches another. The reward comes from a configured function, `verify: package.module:function`,
called as `function(request, session)` with the verify body (task row + final response, as JSON)
and the rollout's MCP session (to read the tools' state): it returns a reward or a `Verdict`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Literal

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field, model_validator

from rollgym import ResourcesServer, RunRequest, Verdict
from rollgym.config import import_target
from rollgym.resources import RESERVED_ROUTES, ResourcesServerConfig, ToolSpec
from rollgym.server import BadRequest, JSONBytesResponse, ServerStartError, SessionId, read_json

class McpConfig(ResourcesServerConfig):
    command: list[str] | None = Field(
        default=None, description="an MCP server to start per rollout (stdio); `python` is this server's interpreter")
    url: str | None = Field(default=None, description="a streamable HTTP MCP endpoint, e.g. http://127.0.0.1:8000/mcp")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of a stdio server")
    cwd: str | None = None
    verify: str = Field(pattern=r"^[\w.]+:[\w.]+$", description="package.module:function computing the reward")
    call_timeout_s: float = Field(default=60.0, gt=0)
    session_store: Literal["memory"] = Field(default="memory", description="MCP sessions live in this process")

    @model_validator(mode="after")
    def _one_transport(self) -> "McpConfig":
        if (self.command is None) == (self.url is None):
            raise ValueError("give exactly one of command (stdio) or url (streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("command: an empty list")
        return self


class McpTool(ToolSpec):
    """An MCP tool as the environment lists it: its own JSON schema, not a pydantic model's."""

    def __init__(self, name: str, description: str, parameters: dict[str, Any]) -> None:
        super().__init__(name, description, BaseModel, "")
        object.__setattr__(self, "parameters", parameters)

    def schema(self) -> dict[str, Any]:
        return {"type": "function", "name": self.name, "description": self.description,
                "parameters": self.parameters, "strict": False}


def tool_output(result: Any) -> str:
    """A CallToolResult as the text the model reads (an error result says so)."""
    parts = [block.text for block in result.content if getattr(block, "type", None) == "text"]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    text = "\n".join(parts)
    return f"Error: {text}" if result.is_error else text


@dataclass(eq=False)
class McpSession:
    """One rollout's MCP client session. The client's transport is owned by one background task
    (anyio scopes must be left in the task that entered them); calls come from any request."""

    target: Any
    timeout_s: float

    async def open(self) -> None:
        from mcp import Client

        self._ready: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()

        async def hold() -> None:
            try:
                async with Client(self.target, read_timeout_seconds=self.timeout_s) as client:
                    self._ready.set_result(client)
                    await self._stop.wait()
            except BaseException as exc:  # noqa: BLE001 - whatever failed, the opener must hear of it
                if not self._ready.done():
                    self._ready.set_exception(exc)

        self._task = asyncio.create_task(hold())
        self.client = await asyncio.wait_for(asyncio.shield(self._ready), self.timeout_s)

    async def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's output text."""
        return tool_output(await self.client.call_tool(name, arguments))

    async def list_tools(self) -> list[Any]:
        return list((await self.client.list_tools()).tools)

    async def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception, asyncio.TimeoutError):
            await asyncio.wait_for(self._task, 10)


class McpEnvironment(ResourcesServer):
    config_class = McpConfig
    config: McpConfig
    task_model = RunRequest

    def __init__(self, config: McpConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.verifier = _resolve(self.config.verify)
        self.open_sessions: set[McpSession] = set()

    def _target(self) -> Any:
        if self.config.url is not None:
            return self.config.url
        from mcp import StdioServerParameters

        command = self.config.command or []
        # `python` is this server's own interpreter (the one with the stack's packages).
        executable = sys.executable if command[0] == "python" else command[0]
        return StdioServerParameters(command=executable, args=command[1:], env=self.config.env or None,
                                     cwd=self.config.cwd)

    async def _session(self) -> McpSession:
        session = McpSession(self._target(), self.config.call_timeout_s)
        await session.open()
        self.open_sessions.add(session)
        return session

    async def startup(self) -> None:
        # The tool list, once: every rollout's session serves the same server.
        try:
            probe = await self._session()
        except Exception as exc:
            raise ServerStartError(f"server {self.name!r}: cannot reach its MCP server: {type(exc).__name__}: {exc}") from None
        try:
            for tool in await probe.list_tools():
                if tool.name in RESERVED_ROUTES:
                    raise ServerStartError(f"server {self.name!r}: MCP tool {tool.name!r} collides with a built-in route")
                self.tools[tool.name] = McpTool(tool.name, tool.description or "", dict(tool.input_schema))
        finally:
            await self._close(probe)

    async def shutdown(self) -> None:
        await asyncio.gather(*(self._close(s) for s in list(self.open_sessions)))

    async def _close(self, session: McpSession) -> None:
        self.open_sessions.discard(session)
        await session.close()

    async def seed(self, task: RunRequest, state: dict[str, Any]) -> None:
        if isinstance(state.get("mcp"), McpSession):  # a session seeded twice: start afresh
            await self._close(state["mcp"])
        state["mcp"] = await self._session()

    async def verify(self, request: Any, state: dict[str, Any]) -> float | Verdict:
        session = state.get("mcp")
        if not isinstance(session, McpSession):
            raise BadRequest("this session was never seeded (POST /seed_session first)", field="session", status=409)
        try:
            outcome = self.verifier(request.model_dump(mode="json"), session)
            return await outcome if inspect.isawaitable(outcome) else outcome
        finally:
            state.pop("mcp", None)
            await self._close(session)

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)  # /seed_session, /verify and /tools first: they win over /{tool}

        @app.post("/{tool_name}")
        async def call_tool(tool_name: str, request: Request, session_id: SessionId) -> JSONBytesResponse:
            if tool_name not in self.tools:
                raise BadRequest(f"unknown tool '{tool_name}'", field="tool", status=404)
            arguments = await read_json(request)
            if not isinstance(arguments, dict):
                raise BadRequest("the arguments must be a JSON object", field="body")
            async with self.session_state(session_id) as state:
                session = state.get("mcp")
                if not isinstance(session, McpSession):
                    raise BadRequest("this session was never seeded (POST /seed_session first)", field="session",
                                     status=409)
                text = await session.call(tool_name, arguments)
            return JSONBytesResponse(text.encode(), media_type="text/plain; charset=utf-8")


def _resolve(target: str) -> Callable[..., Any]:
    try:
        return import_target(target)
    except ValueError as exc:
        raise ServerStartError(f"verify: {exc}") from None
