"""The environment's tools over MCP, for agents built on MCP: `{proxy}/rollouts/{id}/mcp` is a
streamable HTTP MCP endpoint (stateless, JSON answers) listing the resources server's tools and
calling them in the rollout's environment session. Same key and same rules as the rollout's
OpenAI-compatible endpoint: another rollout's key is refused, so is a call after the end.
"""

from __future__ import annotations

from contextlib import AsyncExitStack
from typing import Any, Awaitable, Callable

import orjson

from rollgym.client import Reply

# The agent's side (ProxyAgent in app.py): the rollout a path's id and key open (BadRequest if none),
# the environment's tool list for it, and one tool call in its environment session.
FindRollout = Callable[[str, str], Any]
ListTools = Callable[[Any], Awaitable[Reply]]
CallTool = Callable[[Any, str, Any], Awaitable[Reply]]


class McpGateway:
    """One MCP server for every rollout; the rollout comes from the path and is checked by key."""

    def __init__(self, find_rollout: FindRollout, list_tools: ListTools, call_tool: CallTool) -> None:
        import mcp_types as types
        from mcp.server.lowlevel import Server
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        self.find_rollout = find_rollout
        self.list_tools = list_tools
        self.call_tool = call_tool
        self.types = types
        server = Server("rollgym-environment", on_list_tools=self._list_tools, on_call_tool=self._call_tool)
        self.manager = StreamableHTTPSessionManager(server, stateless=True, json_response=True)
        self._stack = AsyncExitStack()

    async def start(self) -> None:
        await self._stack.enter_async_context(self.manager.run())

    async def stop(self) -> None:
        await self._stack.aclose()

    def _rollout(self, ctx: Any) -> Any:
        request = ctx.request
        return self.find_rollout(request.path_params.get("rollout_id", ""), request.headers.get("authorization", ""))

    async def _list_tools(self, ctx: Any, params: Any) -> Any:
        reply = await self.list_tools(self._rollout(ctx))
        tools = [self.types.Tool(name=tool["name"], description=tool.get("description") or "",
                                 input_schema=tool.get("parameters") or {"type": "object"}) for tool in reply.json()]
        return self.types.ListToolsResult(tools=tools)

    async def _call_tool(self, ctx: Any, params: Any) -> Any:
        rollout = self._rollout(ctx)
        reply = await self.call_tool(rollout, params.name, params.arguments or {})
        text = reply.text
        if reply.status >= 400:  # unknown tool, bad arguments: for the model to read, as MCP errors are
            try:
                text = str(orjson.loads(reply.body)["error"]["message"])
            except (ValueError, KeyError, TypeError):
                pass
        return self.types.CallToolResult(content=[self.types.TextContent(type="text", text=text)],
                                         is_error=reply.status >= 400)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        """The ASGI app mounted at /rollouts/{rollout_id}/mcp: refuses what the rollout's key does not
        open before any MCP happens."""
        from starlette.requests import Request

        from rollgym.server import BadRequest, invalid_request

        request = Request(scope)
        try:
            self.find_rollout(request.path_params.get("rollout_id", ""), request.headers.get("authorization", ""))
        except BadRequest as exc:
            await invalid_request(exc.errors, exc.status)(scope, receive, send)
            return
        await self.manager.handle_request(scope, receive, send)
