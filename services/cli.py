"""The `rollgym` command line."""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the heavy imports, so reported start-up times are honest

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import orjson

from .client import ServerAddress, ServerClient, registry_from_json
from .collector import CollectOptions, Collector, companion_paths
from .config import ConfigError, StackConfig, load_stack
from .launcher import LaunchError, Stack


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
        print(f"  {name:<{width}}  {address.url}  ({spec.role}/{spec.folder})")


def cmd_run(args: argparse.Namespace) -> int:
    files, overrides = split_configs(args.configs)
    config = load_stack(files, overrides)
    stack = Stack(config)
    stopping = False

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        registry = stack.start()
        print(f"rollgym: stack ready in {time.perf_counter() - STARTED:.2f} s", flush=True)
        print_registry(registry, config)
        if args.registry_file:
            Path(args.registry_file).write_bytes(
                orjson.dumps({n: a.to_json() for n, a in registry.items()}, option=orjson.OPT_INDENT_2)
            )
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
            stack = Stack(config)
            registry = stack.start()
            print(f"rollgym: stack ready in {time.perf_counter() - STARTED:.2f} s", file=sys.stderr)
        elif args.registry_file:
            registry = registry_from_json(orjson.loads(Path(args.registry_file).read_bytes()))
        elif args.agent_url:
            registry = {"agent": ServerAddress(url=args.agent_url, role="agents")}
        else:
            raise UsageError("say where the agent is: --config FILE... (start a stack), --registry-file, or --agent-url")
        agent = _pick_agent(registry, args.agent)
        summary = asyncio.run(_collect(registry, agent, options, args.concurrency))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollgym", description="Rollouts and rewards for RL of LLM agents.")
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="start every server of a stack and keep it running")
    run.add_argument("configs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                     help="server config files (configs/*.yaml) and key.path=value overrides")
    run.add_argument("--registry-file", help="also write the registry (name -> URL) to this JSON file")
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
    collect.set_defaults(handler=cmd_collect)

    test = commands.add_parser("test", help="a server folder's tests, then a live check of its server")
    test.add_argument("folders", nargs="*", metavar="FOLDER", help="e.g. resources_servers/weather")
    test.add_argument("--all", action="store_true", help="every folder under models/, agents/, resources_servers/")
    test.add_argument("--no-tests", action="store_true", help="only the live check")
    test.set_defaults(handler=cmd_test)

    init = commands.add_parser("init", help="scaffold a new environment folder that passes `rollgym test`")
    init.add_argument("folder", metavar="resources_servers/NAME")
    init.set_defaults(handler=cmd_init)

    # Trainer-side data tools; each module declares its own options (services/export.py, ...).
    from . import curriculum, export, prepare

    for module in (export, curriculum, prepare):
        module.register(commands, cmd_data_tool)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
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
