"""Runs one server of a stack in this process: `python -m rollgym.serve STACK_FILE NAME [--fd N]`.

The launcher writes the stack file (servers, registry, session secret) and hands each child an
already-bound listening socket, so ports are chosen without races and known before any child starts.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

import orjson
from pydantic import ValidationError

from .client import registry_from_json
from .config import ServerSpec, format_validation_error
from .server import BaseServer, ServerStartError


def load_server_class(spec: ServerSpec) -> type[BaseServer]:
    """Import a server folder's entrypoint and return the one BaseServer subclass it defines."""
    if spec.root not in sys.path:
        sys.path.insert(0, spec.root)
    module = importlib.import_module(spec.module)
    classes = [
        obj for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, BaseServer) and obj.__module__ == module.__name__
        and not inspect.isabstract(obj)
    ]
    if len(classes) != 1:
        names = ", ".join(c.__name__ for c in classes) or "none"
        raise ServerStartError(f"{spec.role}/{spec.folder}/{spec.entrypoint} must define exactly one server class (found: {names})")
    return classes[0]


def build_server(spec: ServerSpec, stack: dict[str, Any]) -> BaseServer:
    """The configured server instance for one entry of a stack file."""
    server_class = load_server_class(spec)
    try:
        config = server_class.config_class.model_validate(spec.options)
    except ValidationError as exc:
        raise ServerStartError(format_validation_error(exc, spec)) from None
    return server_class(
        config, name=spec.name, registry=registry_from_json(stack["registry"]), session_secret=stack["secret"]
    )


def preload(stack: dict[str, Any]) -> None:
    """Import what every server needs, and each server's module, so forked children start warm."""
    import uvicorn  # noqa: F401

    from . import agent, model, resources  # noqa: F401

    for entry in stack["servers"].values():
        try:
            load_server_class(ServerSpec(**entry))
        except Exception:
            pass  # the child reports it with the server's name


def run_server(stack: dict[str, Any], name: str, fd: int | None) -> int:
    """Build and serve one server of `stack` until it is told to stop; returns the exit code."""
    spec = ServerSpec(**stack["servers"][name])
    try:
        server = build_server(spec, stack)
    except ServerStartError as exc:
        print(f"rollgym: server '{name}' cannot start:\n{exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # an import error in the server's own code
        print(f"rollgym: server '{name}' cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    config = uvicorn.Config(
        server.build_app(),
        host=server.config.host,
        port=server.config.port,
        fd=fd,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=75,
        backlog=4096,
    )
    uvicorn.Server(config).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rollgym.serve")
    parser.add_argument("stack_file")
    parser.add_argument("name")
    parser.add_argument("--fd", type=int, default=None, help="an inherited, bound listening socket")
    args = parser.parse_args(argv)
    stack = orjson.loads(Path(args.stack_file).read_bytes())
    return run_server(stack, args.name, args.fd)


if __name__ == "__main__":
    sys.exit(main())
