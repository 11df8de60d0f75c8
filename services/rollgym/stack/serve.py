"""Runs one server of a stack in this process: `python -m rollgym.stack.serve STACK_FILE NAME [--fd N] [--replica I]`.

The launcher writes the stack file (servers, registry, session secret) and hands each child an
already-bound listening socket, so ports are chosen without races and known before any child starts.
A replica of a server that runs as several (`replicas: N`) tags its responses with
`X-Rollgym-Replica: I`, and its `/health` answers with `X-Rollgym-Requests`: the requests other than
/health it has served, so an operator (or a test) sees how the load spreads.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from ..client import registry_from_json
from ..config import ServerSpec, format_validation_error
from ..errors import ServerStartError
from .limits import raise_open_file_limit

if TYPE_CHECKING:  # the web stack loads only when a server is built
    from ..server import BaseServer


def build_server(spec: ServerSpec, stack: dict[str, Any], replica: int = 0) -> BaseServer:
    """The configured server instance for one entry of a stack file (replica `replica` of it)."""
    from ..server import load_server_class

    server_class = load_server_class(spec)
    try:
        config = server_class.config_class.model_validate(spec.options)
    except ValidationError as exc:
        raise ServerStartError(format_validation_error(exc, spec)) from None
    if replica and isinstance(getattr(config, "seed", None), int):
        # Replicas of a seeded server (the embedded model) sample differently: replica i draws from seed + i.
        # With one seed, two replicas answering a task's repeats at once would give identical rollouts.
        config = config.model_copy(update={"seed": config.seed + replica})
    return server_class(
        config, name=spec.name, registry=registry_from_json(stack["registry"]), session_secret=stack["secret"]
    )


def preload(stack: dict[str, Any]) -> None:
    """Import what every server needs, and each server's module, so forked children start warm."""
    import pydantic.v1  # noqa: F401 - FastAPI imports it lazily while it builds the first route
    import uvicorn  # noqa: F401
    import uvicorn.lifespan.on  # noqa: F401 - the modules uvicorn.Config.load() picks for uvicorn_config's choices
    import uvicorn.protocols.http.httptools_impl  # noqa: F401
    import uvloop  # noqa: F401

    from .. import agent, model, resources  # noqa: F401
    from ..server import load_server_class

    for entry in stack["servers"].values():
        try:
            load_server_class(ServerSpec(**entry))
        except Exception:
            pass  # the child reports it with the server's name


class ReplicaHeaders:
    """Tags every response with the replica's index, and /health with the requests served so far."""

    def __init__(self, app: Any, replica: int) -> None:
        self.app = app
        self.replica = str(replica).encode()
        self.served = 0

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        health = scope.get("path") == "/health"
        if not health:
            self.served += 1

        async def tagged(message: dict) -> None:
            if message["type"] == "http.response.start":
                extra = [(b"x-rollgym-replica", self.replica)]
                if health:
                    extra.append((b"x-rollgym-requests", str(self.served).encode()))
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        await self.app(scope, receive, tagged)


def build_replica(stack: dict[str, Any], name: str, replica: int = 0) -> tuple[BaseServer, Any]:
    """The server and ASGI app of one replica of server `name` of `stack`; raises ServerStartError
    (or the server code's own import error) when it cannot be built."""
    spec = ServerSpec(**stack["servers"][name])
    server = build_server(spec, stack, replica)
    app: Any = server.build_app()
    if spec.replicas > 1:
        app = ReplicaHeaders(app, replica)
    return server, app


def uvicorn_config(server: BaseServer, app: Any, *, fd: int | None = None, loop: str = "uvloop") -> Any:
    """How every rollgym server runs under uvicorn."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=server.config.host,
        port=server.config.port,
        fd=fd,
        loop=loop,
        http="httptools",
        ws="none",  # no server speaks websockets: not importing their protocol saves each child ~20 ms
        log_level="warning",
        access_log=False,
        # Servers are addressed directly, not behind a proxy: skip the proxy-header layer.
        proxy_headers=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=75,
        backlog=4096,
    )


YOUNG_GC_THRESHOLD = 20_000


def run_server(stack: dict[str, Any], name: str, fd: int | None, replica: int = 0) -> int:
    """Build and serve one server (one replica of it) of `stack` until it is told to stop; returns the exit code."""
    try:
        server, app = build_replica(stack, name, replica)
    except ServerStartError as exc:
        print(f"rollgym: server '{name}' cannot start:\n{exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # an import error in the server's own code
        print(f"rollgym: server '{name}' cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    import logging

    import uvicorn

    from ..server import StartupFailureFilter

    config = uvicorn_config(server, app, fd=fd)
    logging.getLogger("uvicorn.error").addFilter(StartupFailureFilter())  # the server's own line says why
    # What is imported and built by now lives as long as the server (~140k objects): frozen out of the
    # cyclic GC's reach, its full passes (~0.1 s each under load) walk only what requests allocate.
    gc.freeze()
    # A young-generation pass every 700 net container allocations (Python's default) fires on the
    # acyclic JSON of the rollouts in flight, not on garbage: 250-400 passes per 1,000 rollouts, 0.15-0.25
    # CPU-ms per rollout in the model and agent servers. Past that transient peak, passes are rare.
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])
    try:
        uvicorn.Server(config).run()
    except SystemExit:  # uvicorn's exit on a failed startup, which the server reported in one line
        if StartupFailureFilter.reported:
            return 2
        raise
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollgym.stack.serve")
    parser.add_argument("stack_file")
    parser.add_argument("name")
    parser.add_argument("--fd", type=int, default=None, help="an inherited, bound listening socket")
    parser.add_argument("--replica", type=int, default=0, help="which replica of the server this is (0-based)")
    args = parser.parse_args(argv)
    raise_open_file_limit()
    stack = orjson.loads(Path(args.stack_file).read_bytes())
    return run_server(stack, args.name, args.fd, args.replica)


if __name__ == "__main__":
    sys.exit(main())
