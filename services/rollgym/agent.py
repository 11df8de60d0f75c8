"""The agent-server role: runs the rollout loop (`POST /run`) and the loop without verify.

An agent subclasses `AgentServer` and implements `run` (task row → verified rollout) and
`respond` (Responses request → the loop's final response, unverified).
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from fastapi import FastAPI, Request

from .schema import ResponsesCreateParams, RunRequest
from .server import BaseServer, JSONBytesResponse, parse_body, read_json
from .tracing import rollout_tracer


VERIFICATION_SKIPPED = "skipped"


def unverified(payload: dict[str, Any], response: dict[str, Any] | None) -> dict[str, Any]:
    """The /run answer of a rollout run with `skip_verification`: no reward (null, never a made-up 0) and
    the marker `verification: "skipped"`; the caller adds status, metrics and ids as for a verified one."""
    return {**payload, "response": response, "reward": None, "verification": VERIFICATION_SKIPPED}


class AgentServer(BaseServer):
    """Base of every agent server."""

    role: ClassVar[str] = "agents"

    def health_details(self) -> dict[str, str]:
        """The policy's model server, so a trainer hot-loads adapters there and nowhere else (not on a judge)."""
        ref = getattr(self.config, "model_server", None)
        return {"model_server": ref.name} if getattr(ref, "name", None) else {}

    async def run(self, task: RunRequest, payload: dict[str, Any]) -> dict[str, Any]:
        """One rollout: the task row (validated, and as plain JSON) → the run response as JSON."""
        raise NotImplementedError

    async def respond(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        """The agent loop for a bare Responses request, without seeding or verifying."""
        raise NotImplementedError

    def add_routes(self, app: FastAPI) -> None:
        tracer = rollout_tracer(self.config, self.name)  # None unless the config sets `tracing`

        @app.post("/run")
        async def run(request: Request) -> JSONBytesResponse:
            payload = await read_json(request)
            task = parse_body(RunRequest, payload)
            if tracer is None:
                return JSONBytesResponse(await self.run(task, payload))
            started = time.time_ns()
            result = await self.run(task, payload)
            tracer.record(payload, result, started, time.time_ns())
            return JSONBytesResponse(result)

        @app.post("/v1/responses")
        async def responses(request: Request) -> JSONBytesResponse:
            payload = await read_json(request)
            params = parse_body(ResponsesCreateParams, payload)
            return JSONBytesResponse(await self.respond(params, payload))
