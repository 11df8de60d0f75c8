"""The model-server role: a stateless OpenAI-compatible endpoint (`/v1/responses`, chat, models).

A model server subclasses `ModelServer` and implements `responses` (and usually
`chat_completions`); `build_response` assembles a valid Responses API response around the output
items it generated, with the token fields trainers need on the generated items.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, ClassVar

from fastapi import FastAPI, Request

from .schema import ResponsesCreateParams
from .server import BadRequest, BaseServer, JSONBytesResponse, parse_body, read_json


class ModelServer(BaseServer):
    """Base of every model server."""

    role: ClassVar[str] = "models"

    def model_names(self) -> list[str]:
        """The model ids listed by `GET /v1/models`."""
        return [self.name]

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        """Answer a Responses API request; `payload` is the validated request as plain JSON."""
        raise NotImplementedError

    async def chat_completions(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Answer a Chat Completions request (plain JSON in, plain JSON out)."""
        raise BadRequest("this model server does not serve /v1/chat/completions", status=404)

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/v1/responses")
        async def responses(request: Request) -> JSONBytesResponse:
            payload = await read_json(request)
            params = parse_body(ResponsesCreateParams, payload)
            if isinstance(payload.get("input"), str):
                payload = {**payload, "input": [{"role": "user", "content": payload["input"]}]}
            return JSONBytesResponse(await self.responses(params, payload))

        @app.post("/v1/chat/completions")
        async def chat_completions(request: Request) -> JSONBytesResponse:
            payload = await read_json(request)
            if not isinstance(payload, dict) or not isinstance(payload.get("messages"), list):
                raise BadRequest("required: a list of chat messages", field="messages")
            if payload.get("stream"):
                raise BadRequest("streaming is not supported; send stream=false", field="stream")
            return JSONBytesResponse(await self.chat_completions(payload))

        @app.get("/v1/models")
        async def models() -> JSONBytesResponse:
            data = [{"id": name, "object": "model", "created": 0, "owned_by": "rollgym"} for name in self.model_names()]
            return JSONBytesResponse({"object": "list", "data": data})


def build_response(
    payload: dict[str, Any],
    output: list[dict[str, Any]],
    *,
    model: str,
    usage: dict[str, Any] | None = None,
    status: str = "completed",
    incomplete_details: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Responses API response (as JSON) for a request `payload` and the generated `output` items."""
    usage = usage or {}
    input_tokens = int(usage.get("input_tokens", 0))
    output_tokens = int(usage.get("output_tokens", 0))
    input_details = usage.get("input_tokens_details") or {}
    output_details = usage.get("output_tokens_details") or {}
    return {
        "id": f"resp_{secrets.token_hex(12)}",
        "object": "response",
        "created_at": int(time.time()),  # seconds, an integer as OpenAI and NeMo Gym send it
        "model": model,
        "status": status,
        "output": output,
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {
                "cached_tokens": int(input_details.get("cached_tokens", 0)),
                "cache_write_tokens": int(input_details.get("cache_write_tokens", 0)),
            },
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": int(output_details.get("reasoning_tokens", 0))},
            "total_tokens": input_tokens + output_tokens,
        },
        "error": None,
        "incomplete_details": incomplete_details,
        "instructions": payload.get("instructions"),
        "metadata": payload.get("metadata"),
        "parallel_tool_calls": payload.get("parallel_tool_calls", True) is not False,
        "temperature": payload.get("temperature"),
        "top_p": payload.get("top_p"),
        "max_output_tokens": payload.get("max_output_tokens"),
        "tool_choice": payload.get("tool_choice") or "auto",
        "tools": payload.get("tools") or [],
    }
