"""The orchestrator's HTTP routes: a trainer says it finished a step; anyone asks where the run stands.

    POST /steps/{step}/done  {"adapter_path": "/shared/adapters/step_3"}   (null or "": no new weights)
    GET  /status             the step being formed, the steps ready for the trainer, what is applied

A signal has the same effect as writing `steps/step_N/ADAPTER` (it writes that file), so a run can be
resumed whichever way its trainer signals. By default the answer comes once the adapter is loaded on
every model server (`?wait=false`: at once, 202). Built on the server base: `GET /health`, 4xx naming
the field at fault, bearer-token auth (required when bound beyond loopback).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from ....server import BaseServer, JSONBytesResponse, ServerConfig, error_body, parse_body, read_json
from ..orchestrator import Orchestrator, OrchestratorError, StepSignalError

# What each refusal is to an HTTP client: no such step; a step it cannot have trained yet; a clash.
_STATUS = {"unknown_step": 404, "not_published": 409, "out_of_order": 409, "conflict": 409}


class StepDone(BaseModel):
    """The body of `POST /steps/{step}/done`."""

    model_config = ConfigDict(extra="forbid")

    adapter_path: str | None = Field(description="where the model servers can read the adapter trained on "
                                                 "this step; null or '' when the step changed no weights")


class StepServer(BaseServer):
    """Serves one orchestrator's routes in the orchestrator's own event loop."""

    role = "orchestrator"

    def __init__(self, orchestrator: Orchestrator, config: ServerConfig | None = None) -> None:
        super().__init__(config or ServerConfig(), name="orchestrator")
        self.orchestrator = orchestrator

    def add_routes(self, app: FastAPI) -> None:
        orchestrator = self.orchestrator

        @app.get("/status")
        async def status() -> dict[str, Any]:
            return orchestrator.status()

        @app.post("/steps/{step}/done")
        async def step_done(step: int, request: Request, wait: bool = True) -> Any:
            body = parse_body(StepDone, await read_json(request))
            assert isinstance(body, StepDone)
            try:
                recorded = await orchestrator.signal_finished(step, body.adapter_path)
            except StepSignalError as exc:
                return JSONBytesResponse(error_body(exc.reason, str(exc), field=exc.field), _STATUS[exc.reason])
            if not wait:
                return JSONBytesResponse({"step": step, "recorded": recorded, "applied": orchestrator.version >= step,
                                          "status": orchestrator.status()}, 202)
            try:
                await orchestrator.until_finished(step)
            except OrchestratorError as exc:  # e.g. a model server refused the adapter: the run stops
                return JSONBytesResponse(error_body("apply_failed", f"step {step}: {exc}"), 502)
            return {"step": step, "recorded": recorded, "applied": True, "status": orchestrator.status()}


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: a free one); ValueError saying why it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto named: asyncio sets TCP_NODELAY only on sockets that say TCP, and without it a keep-alive
    # client waits ~40 ms per answer (Nagle against delayed ACKs).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {getattr(exc, 'strerror', None) or exc}") from None
    sock.listen(128)
    return sock


async def run_with_routes(orchestrator: Orchestrator, server: StepServer, sock: socket.socket,
                          **run_options: Any) -> None:
    """`orchestrator.run_step_folders(**run_options)` with the routes served on `sock` meanwhile."""
    import uvicorn

    config = uvicorn.Config(server.build_app(), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=2)
    http = uvicorn.Server(config)
    # Ctrl-C must stop the orchestrator (and the routes with it), not be taken by uvicorn for itself.
    http.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    serving = asyncio.create_task(http.serve(sockets=[sock]))
    try:
        await orchestrator.run_step_folders(**run_options)
    finally:
        http.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)


__all__ = ["StepDone", "StepServer", "listen_socket", "run_with_routes"]
