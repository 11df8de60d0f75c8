"""Operating a stack: `run`, `serve-one` and `compose` (rollgym.stack)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .common import STARTED, UsageError, env_registry, print_registry, stack_for, write_private


def register(commands: Any) -> None:
    run = commands.add_parser("run", help="start every server of a stack and keep it running")
    run.add_argument("configs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                     help="server config files (configs/*.yaml) and key.path=value overrides")
    run.add_argument("--registry-file", help="also write the registry (name -> URL) to this JSON file")
    run.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="start the servers as actors of a Ray cluster (pip install 'rollgym[ray]'); ADDRESS: "
                          "HOST:PORT, auto, local or ray://...; none: the cluster of this machine, else a new one")
    run.set_defaults(handler=run_stack)

    # Deployment (docs/deploy.md): one server per container, and the compose file of a stack.
    serve_one = commands.add_parser("serve-one", help="serve one server of a stack; the registry locates the others")
    serve_one.add_argument("configs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                           help="the stack's config files and key.path=value overrides, as for `rollgym run`")
    serve_one.add_argument("--name", required=True, help="the server of the stack to serve (all its replicas)")
    serve_one.add_argument("--host", help="listen here (default: the config's host); beyond loopback needs a "
                                          "token: its auth_token or ROLLGYM_AUTH_TOKEN")
    serve_one.add_argument("--port", type=int, help="listen here; replicas on the next ports (default: the config's)")
    serve_one.add_argument("--registry", action="append", metavar="NAME=URL[,URL...]",
                           help="where another server of the stack is (one URL per replica); also read from "
                                "ROLLGYM_REGISTRY (registry JSON); ROLLGYM_AUTH_TOKEN is their bearer token")
    serve_one.add_argument("--registry-file", help="a registry JSON file (as `rollgym run --registry-file` writes)")
    serve_one.set_defaults(handler=run_serve_one)

    compose = commands.add_parser("compose", help="print the docker-compose file that runs a stack")
    compose.add_argument("configs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                         help="server config files (relative to the project folder) and key.path=value overrides")
    compose.add_argument("--external-model", action="store_true",
                         help="print the override file that swaps policy_model for an external OpenAI-compatible "
                              "endpoint (ROLLGYM_MODEL_BASE_URL, ROLLGYM_MODEL_NAME)")
    compose.add_argument("--port", type=int, default=8000, help="the port servers listen on in their containers")
    compose.add_argument("--image", default="rollgym:latest", help="the image every service runs")
    compose.add_argument("--collect-agent", help="the collect service's default agent (default: the first agent)")
    compose.add_argument("--collect-input", help="the collect service's default tasks (default: that agent's "
                                                 "environment's data/example.jsonl)")
    compose.set_defaults(handler=run_compose)


def _raise_keyboard_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _stop_on_sigint_and_sigterm() -> None:
    # Ctrl-C (SIGINT) and `kill`/`docker stop` (SIGTERM) end the loop, which stops the stack. SIGINT's
    # handler is set here, not left to Python: a background job of a script starts with SIGINT
    # ignored, and Python then keeps it ignored, so "Press Ctrl-C to stop" would not hold.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)


def run_stack(args: argparse.Namespace) -> int:
    import orjson

    from ..config import load_stack, split_configs

    files, overrides = split_configs(args.configs)
    config = load_stack(files, overrides)
    stack = stack_for(config, args.ray)
    stopping = False
    _stop_on_sigint_and_sigterm()
    try:
        registry = stack.start()
        print(f"rollgym: stack ready in {time.perf_counter() - STARTED:.2f} s", flush=True)
        print_registry(registry, config)
        if args.registry_file:
            write_private(Path(args.registry_file),
                          orjson.dumps({n: a.to_json() for n, a in registry.items()}, option=orjson.OPT_INDENT_2))
            print(f"  registry written to {args.registry_file}")
        print("Press Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(0.2)
            dead = stack.dead()
            if dead:
                print(f"rollgym: server '{dead[0]}' exited with code {dead[1]}; stopping the stack", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        stopping = True
        return 0
    finally:
        if stopping:
            print("rollgym: stopping the stack", file=sys.stderr)
        stack.stop()


def run_serve_one(args: argparse.Namespace) -> int:
    """One server of a stack (all its replicas), the others located by the registry: a container's command."""
    import os


    from ..client import AUTH_TOKEN_ENV, REGISTRY_ENV, load_registry_file, parse_registry_items
    from ..config import load_stack, split_configs
    from ..stack.compose import missing_references, single_server_stack
    from ..stack.launcher import Stack

    files, overrides = split_configs(args.configs)
    config = load_stack(files, overrides)
    token = os.environ.get(AUTH_TOKEN_ENV) or None
    registry = env_registry() or {}
    try:
        if args.registry_file:
            registry.update(load_registry_file(args.registry_file, auth_token=token))
        registry.update(parse_registry_items(args.registry or [], auth_token=token))
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    served = single_server_stack(config, args.name, host=args.host, port=args.port)
    missing = missing_references(config, args.name, registry)
    if missing:
        raise UsageError(f"server '{args.name}' calls {', '.join(missing)}: say where with "
                         f"--registry NAME=URL, --registry-file or {REGISTRY_ENV}")
    stack = Stack(served, registry=registry)
    _stop_on_sigint_and_sigterm()  # also `docker stop`: as PID 1, nothing else would end it
    try:
        stack.start()
        print(f"rollgym: server '{args.name}' ready in {time.perf_counter() - STARTED:.2f} s", flush=True)
        for process_name in stack.replicas(args.name):
            print(f"  {process_name}  {stack.replica_url(process_name)}", flush=True)
        while True:
            time.sleep(0.2)
            dead = stack.dead()
            if dead:
                print(f"rollgym: server '{dead[0]}' exited with code {dead[1]}", file=sys.stderr)
                return 1
    except KeyboardInterrupt:
        return 0
    finally:
        stack.stop()


def run_compose(args: argparse.Namespace) -> int:
    """Print the docker-compose project (or the external-model override) of a stack."""
    import shlex

    from ..config import load_stack, split_configs
    from ..stack.compose import ComposeOptions, compose_project, external_model_override, header, to_yaml

    files, overrides = split_configs(args.configs)
    config = load_stack(files, overrides)
    options = ComposeOptions(port=args.port, image=args.image, collect_agent=args.collect_agent,
                             collect_input=args.collect_input)
    flags = ["--external-model"] if args.external_model else []
    for flag, value, default in (("--port", args.port, ComposeOptions.port), ("--image", args.image, ComposeOptions.image),
                                 ("--collect-agent", args.collect_agent, None), ("--collect-input", args.collect_input, None)):
        if value != default:
            flags += [flag, str(value)]
    command = " ".join(["rollgym compose", *map(shlex.quote, [*args.configs, *flags])])
    if args.external_model:
        project = external_model_override(config, files, overrides, options)
    else:
        project = compose_project(config, files, overrides, options)
    sys.stdout.write(to_yaml(project, header(command, external_model=args.external_model)))
    return 0
