"""`rollgym orchestrate CONFIG.yaml --registry-file stack.json --output DIR`: step folders for a trainer elsewhere."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import UsageError, env_registry


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "orchestrate", help="stream training batches of a running stack into step folders for an external trainer",
        description="Runs the async RL orchestrator (docs/train-async.md) against a running stack and "
                    "publishes each step's batch as OUTPUT/steps/step_N/ (batch.jsonl, meta.json, READY written "
                    "last). The trainer writes the path of the adapter it trained to step_N/ADAPTER (or, with "
                    "--listen, POSTs it to /steps/N/done); it is hot-loaded on every model server before later steps generate. Run it again on the same "
                    "output to resume.")
    parser.add_argument("config", help="the orchestrator config YAML (batch_size, rollouts_per_example, envs, ...)")
    parser.add_argument("--registry-file", help="the running stack (written by `rollgym run --registry-file`); "
                                                "default: ROLLGYM_REGISTRY in a compose container")
    parser.add_argument("--output", required=True, help="the run's folder: steps/, history.jsonl, failures.jsonl")
    parser.add_argument("--poll-s", type=float, default=0.2, help="how often to look for the trainer's ADAPTER files")
    parser.add_argument("--no-wait", action="store_true", help="exit once the last step is published, without "
                                                               "waiting for the trainer to finish it")
    parser.add_argument("--listen", metavar="HOST:PORT",
                        help="also serve POST /steps/{N}/done {adapter_path} (the trainer's signal, as the ADAPTER "
                             "file) and GET /status on HOST:PORT (port 0: a free one); beyond loopback the bearer "
                             "token in ROLLGYM_AUTH_TOKEN is required")
    parser.set_defaults(handler=cmd_orchestrate)


def cmd_orchestrate(args: argparse.Namespace) -> int:
    import asyncio
    import os

    from ..client import load_registry_file
    from ..train.orchestrator.orchestrator import Orchestrator, OrchestratorError
    from ..train.orchestrator.config import load_orchestrator_config

    if args.poll_s <= 0:
        raise UsageError("--poll-s must be positive")
    listen = _host_port(args.listen) if args.listen else None
    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise UsageError(f"--output {args.output} is a file; a run's output is a folder")
    try:
        config = load_orchestrator_config(args.config)
        registry = load_registry_file(args.registry_file) if args.registry_file else env_registry()
        if registry is None:
            raise UsageError("say which stack: --registry-file FILE (written by `rollgym run --registry-file`)")
        orchestrator = Orchestrator(config, registry, args.output, log=lambda m: print(m, file=sys.stderr))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    options = {"poll_s": args.poll_s, "wait_for_trainer": not args.no_wait}
    run = _with_routes(orchestrator, *listen, **options) if listen else orchestrator.run_step_folders(**options)
    try:
        asyncio.run(run)
    except OrchestratorError as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rollgym: stopped; run the same command again to resume from {args.output}", file=sys.stderr)
        return 130
    print(f"published steps 1..{orchestrator.next_step - 1} in {orchestrator.folders.root}; "
          f"history: {orchestrator.output / 'history.jsonl'}")
    return 0


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")  # [::1]:8080
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise UsageError(f"--listen {text!r} must look like HOST:PORT (e.g. 127.0.0.1:8089, port 0: a free one)")
    return host, int(port)


def _with_routes(orchestrator: Any, host: str, port: int, **run_options: Any) -> Any:
    """The run with the trainer's HTTP routes served meanwhile; UsageError when they cannot be."""
    import os

    from ..client import AUTH_TOKEN_ENV
    from ..server import ServerConfig, is_loopback
    from ..train.orchestrator.transports.http import StepServer, listen_socket, run_with_routes

    token = os.environ.get(AUTH_TOKEN_ENV) or None
    if token is None and not is_loopback(host):
        raise UsageError(f"--listen {host}:{port} is beyond loopback: set {AUTH_TOKEN_ENV} to the bearer token "
                         "trainers must send, or listen on 127.0.0.1")
    server = StepServer(orchestrator, ServerConfig(host=host, port=port, auth_token=token))
    try:
        sock = listen_socket(host, port)
    except ValueError as exc:
        raise UsageError(f"--listen: {exc}") from None
    bound = sock.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"trainer signals: POST http://{shown}:{bound[1]}/steps/{{N}}/done; GET http://{shown}:{bound[1]}/status",
          file=sys.stderr, flush=True)
    return run_with_routes(orchestrator, server, sock, **run_options)
