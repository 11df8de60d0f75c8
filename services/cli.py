"""The `rollgym` command line."""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the heavy imports, so reported start-up times are honest

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import orjson

from .client import ServerAddress, ServerClient, registry_from_json
from .collector import CollectOptions, Collector, companion_paths
from .config import ConfigError, StackConfig, load_stack
from .launcher import LaunchError, Stack, raise_open_file_limit


class UsageError(Exception):
    """A command-line mistake, reported as `rollgym: error: ...` with exit code 2."""


def split_configs(items: list[str]) -> tuple[list[str], list[str]]:
    """Positional arguments → (config files, key=value overrides)."""
    files, overrides = [], []
    for item in items:
        if "=" in item and not Path(item).exists():
            overrides.append(item)
        else:
            files.append(item)
    return files, overrides


def print_registry(registry: dict[str, ServerAddress], config: StackConfig) -> None:
    width = max(len(name) for name in registry)
    for name, address in registry.items():
        spec = config.servers[name]
        print(f"  {name:<{width}}  {' '.join(address.urls)}  ({spec.role}/{spec.folder})")


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read (a registry holds the servers' bearer tokens)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(descriptor, 0o600)  # also when the file already existed with looser permissions
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def cmd_run(args: argparse.Namespace) -> int:
    files, overrides = split_configs(args.configs)
    config = load_stack(files, overrides)
    stack = _stack_for(config, args.ray)
    stopping = False

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
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


def cmd_collect(args: argparse.Namespace) -> int:
    input_path = Path(args.input)
    if not input_path.is_file():
        raise UsageError(f"--input: no such file: {input_path}")
    if args.repeats < 1 or args.concurrency < 1 or args.max_attempts < 1:
        raise UsageError("--repeats, --concurrency and --max-attempts must be at least 1")
    params: dict[str, Any] = {}
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--param {item!r} must look like KEY=JSON, e.g. tool_choice=\"required\"")
        try:
            params[key] = orjson.loads(value)
        except orjson.JSONDecodeError:
            params[key] = value  # a bare word such as required or auto
    for key in ("temperature", "top_p", "max_output_tokens", "model"):
        value = getattr(args, key)
        if value is not None:
            params[key] = value
    options = CollectOptions(
        input=input_path, output=Path(args.output), repeats=args.repeats, concurrency=args.concurrency,
        limit=args.limit, params=params, max_attempts=args.max_attempts, timeout_s=args.timeout,
        pass_threshold=args.pass_threshold, progress=not args.no_progress,
    )
    stack: Stack | None = None
    try:
        if args.config:
            files, overrides = split_configs(args.config)
            config = load_stack(files, overrides)
            stack = _stack_for(config, args.ray)
            registry = stack.start()
            print(f"rollgym: stack ready in {time.perf_counter() - STARTED:.2f} s", file=sys.stderr)
        elif args.registry_file:
            registry = registry_from_json(orjson.loads(Path(args.registry_file).read_bytes()))
        elif args.agent_url:
            registry = {"agent": ServerAddress(url=args.agent_url, role="agents")}
        elif _env_registry() is not None:  # a container of a compose stack (services/compose.py)
            registry = _env_registry()
        else:
            raise UsageError("say where the agent is: --config FILE... (start a stack), --registry-file, "
                             "--agent-url, or ROLLGYM_REGISTRY")
        agent = _pick_agent(registry, args.agent)
        summary = _run_collection(args, registry, agent, options)
    finally:
        if stack is not None:
            stack.stop()
    print_summary(summary, options)
    return 0


async def _collect(registry: dict[str, ServerAddress], agent: str, options: CollectOptions, concurrency: int) -> dict:
    client = ServerClient(registry, timeout_s=options.timeout_s, max_retries=2)
    try:
        return await Collector(client, agent, options, log=lambda m: print(f"rollgym: {m}", file=sys.stderr)).run()
    finally:
        await client.close()


def _pick_agent(registry: dict[str, ServerAddress], wanted: str | None) -> str:
    agents = [name for name, address in registry.items() if address.role in ("agents", "")]
    if wanted:
        if wanted not in registry:
            raise UsageError(f"--agent: no server named '{wanted}' (agents: {', '.join(agents) or 'none'})")
        return wanted
    if len(agents) == 1:
        return agents[0]
    if not agents:
        raise UsageError("the stack has no agent server")
    raise UsageError(f"the stack has several agents ({', '.join(agents)}); pick one with --agent")


def print_summary(summary: dict[str, Any], options: CollectOptions) -> None:
    run = summary["run"]
    failures_path, metrics_path = companion_paths(options.output)
    lines = [
        f"collected {summary['rollouts']} rollouts in {summary['groups']} groups "
        f"({run['new_rollouts']} new in {run['wall_s']:.1f} s, {run['rollouts_per_s'] or 0:.1f} rollouts/s)",
    ]
    if summary["mean_reward"] is not None:
        pass_k = "  ".join(f"{k} {v:.3f}" for k, v in summary.items() if k.startswith("pass@"))
        lines.append(f"mean reward {summary['mean_reward']:.3f} (std {summary['reward_std']:.3f})  {pass_k}")
    lines.append("status: " + ", ".join(f"{k} {v}" for k, v in summary["status_counts"].items()))
    tokens, latency = summary["tokens"], summary["latency_s"]
    if summary["rollouts"]:
        lines.append(f"tokens per rollout: {tokens['input_mean']:.0f} in, {tokens['output_mean']:.0f} out")
        lines.append(f"latency: p50 {latency['p50']:.3f} s  p95 {latency['p95']:.3f} s  p99 {latency['p99']:.3f} s")
    lines.append(f"failed (not counted as reward): {summary['failed']}  -> {failures_path}")
    lines.append(f"rollouts -> {options.output}   metrics -> {metrics_path}")
    print("\n".join(lines))


def cmd_data_tool(args: argparse.Namespace) -> int:
    """export, curriculum and prepare-data: the module's `command(args)`; its DataError is a usage error."""
    import importlib

    from .export import DataError

    module = importlib.import_module(f".{args.data_module}", __package__)
    try:
        return module.command(args)
    except DataError as exc:
        raise UsageError(str(exc)) from None


def cmd_test(args: argparse.Namespace) -> int:
    from .folder_check import check_folder, server_folders

    if args.all:
        folders = server_folders(Path.cwd())
        if not folders:
            raise UsageError("--all: no server folders here; run it from the repository root")
    elif args.folders:
        folders = [Path(folder) for folder in args.folders]
    else:
        raise UsageError("name a server folder (e.g. resources_servers/weather) or pass --all")
    reports = [check_folder(folder, run_tests=not args.no_tests) for folder in folders]
    failed = [report for report in reports if not report.ok]
    print(f"{len(reports) - len(failed)} passed, {len(failed)} failed")
    for report in failed:
        print(f"  failed: {report.folder.parent.name}/{report.folder.name}")
    return 1 if failed else 0


def cmd_init(args: argparse.Namespace) -> int:
    from .scaffold import scaffold

    try:
        written = scaffold(Path(args.folder))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for path in written:
        print(f"  wrote {path}")
    print(f"next: edit {args.folder}/app.py, then `rollgym test {args.folder}`")
    return 0


def cmd_check_tokens(args: argparse.Namespace) -> int:
    from .token_check import CheckUsageError, command

    try:
        return command(args)
    except CheckUsageError as exc:
        raise UsageError(str(exc)) from None


# --- deployment: Ray, containers (docs/deploy.md) ---------------------------------------------------


def _stack_for(config: StackConfig, ray_address: str | None) -> Any:
    """The local launcher's Stack, or with `--ray [ADDRESS]` the stack as Ray actors."""
    if ray_address is None:
        return Stack(config)
    if ray_address.endswith((".yaml", ".yml")) or "=" in ray_address or Path(ray_address).is_file():
        raise UsageError(f"--ray took {ray_address!r} as the cluster address: put --ray after the configs, "
                         "or write --ray=ADDRESS")
    from .ray_runner import RayStack

    return RayStack(config, ray_address or None)


def _run_collection(args: argparse.Namespace, registry: dict[str, ServerAddress], agent: str,
                    options: CollectOptions) -> dict[str, Any]:
    if args.ray is None:
        return asyncio.run(_collect(registry, agent, options, args.concurrency))
    if args.ray_collectors < 1:
        raise UsageError("--ray-collectors must be at least 1")
    from .ray_runner import collect_on_ray

    return collect_on_ray(registry, agent, options, address=args.ray or None, collectors=args.ray_collectors,
                          log=lambda message: print(f"rollgym: {message}", file=sys.stderr))


def _env_registry() -> dict[str, ServerAddress] | None:
    import os

    from .client import registry_from_env

    try:
        return registry_from_env(os.environ)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def cmd_serve_one(args: argparse.Namespace) -> int:
    """One server of a stack (all its replicas), the others located by the registry: a container's command."""
    import os

    from .client import AUTH_TOKEN_ENV, REGISTRY_ENV, parse_registry_items
    from .compose import missing_references, single_server_stack

    files, overrides = split_configs(args.configs)
    config = load_stack(files, overrides)
    token = os.environ.get(AUTH_TOKEN_ENV) or None
    registry = _env_registry() or {}
    try:
        if args.registry_file:
            registry.update(registry_from_json(orjson.loads(Path(args.registry_file).read_bytes()), auth_token=token))
        registry.update(parse_registry_items(args.registry or [], auth_token=token))
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    served = single_server_stack(config, args.name, host=args.host, port=args.port)
    missing = missing_references(config, args.name, registry)
    if missing:
        raise UsageError(f"server '{args.name}' calls {', '.join(missing)}: say where with "
                         f"--registry NAME=URL, --registry-file or {REGISTRY_ENV}")
    stack = Stack(served, registry=registry)

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)  # `docker stop`; as PID 1 nothing else would end it
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


def cmd_compose(args: argparse.Namespace) -> int:
    """Print the docker-compose project (or the external-model override) of a stack."""
    import shlex

    from .compose import ComposeOptions, compose_project, external_model_override, header, to_yaml

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollgym", description="Rollouts and rewards for RL of LLM agents.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start every server of a stack and keep it running")
    run.add_argument("configs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                     help="server config files (configs/*.yaml) and key.path=value overrides")
    run.add_argument("--registry-file", help="also write the registry (name -> URL) to this JSON file")
    run.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="start the servers as actors of a Ray cluster (pip install 'rollgym[ray]'); ADDRESS: "
                          "HOST:PORT, auto, local or ray://...; none: the cluster of this machine, else a new one")
    run.set_defaults(handler=cmd_run)

    collect = commands.add_parser("collect-rollouts", help="run tasks through an agent and write rollouts JSONL")
    collect.add_argument("--input", required=True, help="tasks JSONL: one row per task")
    collect.add_argument("--output", required=True, help="rollouts JSONL (appended; reruns resume)")
    where = collect.add_mutually_exclusive_group()
    where.add_argument("--config", nargs="+", metavar="CONFIG_OR_OVERRIDE", help="start this stack for the run")
    where.add_argument("--registry-file", help="use a running stack (written by `rollgym run --registry-file`)")
    where.add_argument("--agent-url", help="use a running agent server at this URL")
    collect.add_argument("--agent", help="which agent of the stack (default: the only one)")
    collect.add_argument("--repeats", type=int, default=1, help="rollouts per task (a GRPO group)")
    collect.add_argument("--concurrency", type=int, default=32, help="rollouts in flight at once")
    collect.add_argument("--limit", type=int, help="use only the first N tasks")
    collect.add_argument("--temperature", type=float)
    collect.add_argument("--top-p", type=float, dest="top_p")
    collect.add_argument("--max-output-tokens", type=int, dest="max_output_tokens")
    collect.add_argument("--model", help="the model name sent to the model server")
    collect.add_argument("--param", action="append", metavar="KEY=JSON",
                         help="set any responses_create_params key on every task, e.g. "
                              "--param 'tool_choice={\"type\": \"function\", \"name\": \"get_weather\"}'")
    collect.add_argument("--max-attempts", type=int, default=3, help="tries per rollout on infrastructure failure")
    collect.add_argument("--timeout", type=float, default=3600.0, help="seconds one rollout may take")
    collect.add_argument("--pass-threshold", type=float, default=1.0, help="reward that counts as a pass for pass@k")
    collect.add_argument("--no-progress", action="store_true", help="no progress bar")
    collect.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                         help="run the rollouts on collector actors of a Ray cluster (and a --config stack as "
                              "actors); ADDRESS as for `rollgym run --ray`")
    collect.add_argument("--ray-collectors", type=int, default=4, metavar="N",
                         help="with --ray: collector actors the tasks are dealt to (default 4)")
    collect.set_defaults(handler=cmd_collect)

    test = commands.add_parser("test", help="a server folder's tests, then a live check of its server")
    test.add_argument("folders", nargs="*", metavar="FOLDER", help="e.g. resources_servers/weather")
    test.add_argument("--all", action="store_true", help="every folder under models/, agents/, resources_servers/")
    test.add_argument("--no-tests", action="store_true", help="only the live check")
    test.set_defaults(handler=cmd_test)

    init = commands.add_parser("init", help="scaffold a new environment folder that passes `rollgym test`")
    init.add_argument("folder", metavar="resources_servers/NAME")
    init.set_defaults(handler=cmd_init)

    # check-tokens: multi-turn rollouts must extend their tokens exactly (services/token_check.py).
    from . import token_check

    token_check.register(commands, cmd_check_tokens)

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
    serve_one.set_defaults(handler=cmd_serve_one)

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
    compose.set_defaults(handler=cmd_compose)

    # Trainer-side data tools; each module declares its own options (services/export.py, ...).
    from . import curriculum, export, prepare

    for module in (export, curriculum, prepare):
        module.register(commands, cmd_data_tool)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    raise_open_file_limit()
    try:
        return args.handler(args)
    except (ConfigError, UsageError) as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("rollgym: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
