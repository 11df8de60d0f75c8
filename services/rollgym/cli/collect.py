"""`rollgym collect-rollouts`: run task rows through an agent and write rollouts (rollgym.rollouts)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import STARTED, UsageError, env_registry, parse_params, stack_for

if TYPE_CHECKING:
    from ..client import ServerAddress
    from ..rollouts.collector import CollectOptions


def register(commands: Any) -> None:
    collect = commands.add_parser("collect-rollouts", help="run tasks through an agent and write rollouts JSONL")
    collect.add_argument("--input", required=True, help="tasks JSONL: one row per task")
    collect.add_argument("--output", required=True, help="rollouts JSONL (appended; reruns resume)")
    where = collect.add_mutually_exclusive_group()
    where.add_argument("--config", nargs="+", metavar="CONFIG_OR_OVERRIDE", help="start this stack for the run")
    where.add_argument("--registry-file", help="use a running stack (written by `rollgym run --registry-file`)")
    where.add_argument("--agent-url", help="use a running agent server at this URL")
    collect.add_argument("--agent", metavar="NAME",
                         help="send every row to this agent of the stack, whatever its agent_ref says (rows written "
                              "for another stack, e.g. NeMo Gym task files); default: each row's agent_ref, else "
                              "the stack's only agent")
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
    collect.add_argument("--timeout", type=float, default=3600.0, help="seconds one attempt of a rollout may take")
    collect.add_argument("--rollout-budget-s", type=float, metavar="SECONDS",
                         help="seconds all the attempts of one rollout may take together, waits included "
                              "(default: no limit beyond --max-attempts × --timeout)")
    collect.add_argument("--pass-threshold", type=float, default=1.0, help="reward that counts as a pass for pass@k")
    collect.add_argument("--skip-verification", action="store_true",
                         help="agents do not call /verify: rollouts carry reward null and verification \"skipped\" "
                              "(for SFT, distillation or filtering; never for reward-based training)")
    collect.add_argument("--no-progress", action="store_true", help="no progress bar")
    collect.add_argument("--allow-failures", action="store_true",
                         help="exit 0 even when rollouts failed after their attempts or none succeeded")
    collect.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                         help="run the rollouts on collector actors of a Ray cluster (and a --config stack as "
                              "actors); ADDRESS as for `rollgym run --ray`")
    collect.add_argument("--ray-collectors", type=int, default=4, metavar="N",
                         help="with --ray: collector actors the tasks are dealt to (default 4)")
    collect.set_defaults(handler=run_collect)


def run_collect(args: argparse.Namespace) -> int:
    from ..client import ServerAddress, load_registry_file
    from ..rollouts.attempts import UnknownAgent
    from ..rollouts.collector import CollectOptions

    input_path, output = Path(args.input), Path(args.output)
    if not input_path.is_file():
        raise UsageError(f"--input: no such file: {input_path}")
    for option in ("repeats", "concurrency", "max_attempts"):
        if getattr(args, option) < 1:
            raise UsageError(f"--{option.replace('_', '-')} must be at least 1, got {getattr(args, option)}")
    for option, value in (("--timeout", args.timeout), ("--rollout-budget-s", args.rollout_budget_s)):
        if value is not None and not value > 0:
            raise UsageError(f"{option} must be a positive number of seconds, got {value}")
    check_output(output, input_path)
    params = parse_params(args.param or [])
    for key in ("temperature", "top_p", "max_output_tokens", "model"):
        value = getattr(args, key)
        if value is not None:
            params[key] = value
    options = CollectOptions(
        input=input_path, output=output, repeats=args.repeats, concurrency=args.concurrency,
        limit=args.limit, params=params, max_attempts=args.max_attempts, timeout_s=args.timeout,
        budget_s=args.rollout_budget_s,
        pass_threshold=args.pass_threshold, progress=not args.no_progress,
        force_agent=bool(args.agent or args.agent_url),  # one agent named: every row goes there
        skip_verification=args.skip_verification,
    )
    stack = None
    try:
        if args.config:
            from ..config import load_stack, split_configs  # only here: omegaconf costs a start-up

            files, overrides = split_configs(args.config)
            config = load_stack(files, overrides)
            stack = stack_for(config, args.ray)
            registry = stack.start()
            print(f"rollgym: stack ready in {time.perf_counter() - STARTED:.2f} s", file=sys.stderr)
        elif args.registry_file:
            try:
                registry = load_registry_file(args.registry_file)
            except ValueError as exc:
                raise UsageError(f"--registry-file: {exc}") from None
        elif args.agent_url:
            registry = {"agent": ServerAddress(url=args.agent_url, role="agents")}
        elif env_registry() is not None:  # a container of a compose stack (rollgym.stack.compose)
            registry = env_registry()
        else:
            raise UsageError("say where the agent is: --config FILE... (start a stack), --registry-file, "
                             "--agent-url, or ROLLGYM_REGISTRY")
        agent = pick_agent(registry, args.agent)
        try:
            summary = _run_collection(args, registry, agent, options)
        except UnknownAgent as exc:
            raise UsageError(f"{exc}. To send every row to one agent, pass --agent NAME") from None
    finally:
        if stack is not None:
            stack.stop()
    print_summary(summary, options)
    return exit_code(summary, allow_failures=args.allow_failures)


def check_output(output: Path, input_path: Path) -> None:
    """Refuse an --output that cannot be written, or that would overwrite the tasks, before anything runs."""
    from ..rollouts.sink import companion_paths

    if output.is_dir():
        raise UsageError(f"--output: {output} is a folder; name a file such as {output / 'rollouts.jsonl'}")
    if output.exists() and output.resolve() == input_path.resolve() or \
            any(path.exists() and path.resolve() == input_path.resolve() for path in companion_paths(output)):
        raise UsageError(f"--output {output} would write over the --input file")
    for parent in output.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"--output: {parent} is a file, so {output} cannot be created")
            break


def exit_code(summary: dict[str, Any], *, allow_failures: bool) -> int:
    """0 when every rollout succeeded; 1 when none did or any ended as a failure (unless allowed)."""
    problem = None
    if summary["rollouts"] == 0:
        problem = "no rollout succeeded"
    elif summary["failed"]:
        problem = f"{summary['failed']} rollouts failed after their attempts"
    if problem is None:
        return 0
    if allow_failures:
        print(f"rollgym: {problem} (exit 0: --allow-failures)", file=sys.stderr)
        return 0
    print(f"rollgym: {problem}: exit 1 (--allow-failures exits 0)", file=sys.stderr)
    return 1


async def _collect(registry: dict[str, ServerAddress], agent: str, options: CollectOptions) -> dict:
    from ..client import ServerClient
    from ..rollouts.collector import Collector

    client = ServerClient(registry, timeout_s=options.timeout_s, max_retries=2)
    try:
        return await Collector(client, agent, options, log=lambda m: print(f"rollgym: {m}", file=sys.stderr)).run()
    finally:
        await client.close()


def pick_agent(registry: dict[str, ServerAddress], wanted: str | None) -> str:
    agents = [name for name, address in registry.items() if address.role in ("agents", "")]
    if wanted:
        if wanted not in registry:
            raise UsageError(f"--agent: no server named '{wanted}' (agents: {', '.join(agents) or 'none'})")
        return wanted
    if len(agents) == 1:
        return agents[0]
    if not agents:
        raise UsageError("the stack has no agent server")
    return ""  # several agents: each row must name its own (agent_ref), checked before anything is sent


def _run_collection(args: argparse.Namespace, registry: dict[str, ServerAddress], agent: str,
                    options: CollectOptions) -> dict[str, Any]:
    import asyncio

    if args.ray is None:
        import uvloop  # the servers' event loop: less of the collector's CPU per rollout than asyncio's own

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_collect(registry, agent, options))
    if args.ray_collectors < 1:
        raise UsageError("--ray-collectors must be at least 1")
    from ..stack.ray import collect_on_ray

    return collect_on_ray(registry, agent, options, address=args.ray or None, collectors=args.ray_collectors,
                          log=lambda message: print(f"rollgym: {message}", file=sys.stderr))


def print_summary(summary: dict[str, Any], options: CollectOptions) -> None:
    from ..rollouts.sink import companion_paths

    run = summary["run"]
    failures_path, metrics_path = companion_paths(options.output)
    lines = [
        f"collected {summary['rollouts']} rollouts in {summary['groups']} groups "
        f"({run['new_rollouts']} new in {run['wall_s']:.1f} s, {run['rollouts_per_s'] or 0:.1f} rollouts/s)",
    ]
    if run.get("skipped_lines"):
        lines.append(f"skipped {run['skipped_lines']} unusable task lines (listed above)")
    if summary["mean_reward"] is not None:
        pass_k = "  ".join(f"{k} {v:.3f}" for k, v in summary.items() if k.startswith("pass@"))
        threshold = f"  (a pass: reward >= {summary['pass_threshold']:g})" if pass_k else ""
        lines.append(f"mean reward {summary['mean_reward']:.3f} (std {summary['reward_std']:.3f})  {pass_k}{threshold}")
    lines.append("status: " + ", ".join(f"{k} {v}" for k, v in summary["status_counts"].items()))
    tokens, latency = summary["tokens"], summary["latency_s"]
    if summary["rollouts"]:
        lines.append(f"tokens per rollout: {tokens['input_mean']:.0f} in, {tokens['output_mean']:.0f} out")
        lines.append(f"latency: p50 {latency['p50']:.3f} s  p95 {latency['p95']:.3f} s  p99 {latency['p99']:.3f} s")
    lines.append(f"failed (not counted as reward): {summary['failed']}  -> {failures_path}")
    lines.append(f"rollouts -> {options.output}   metrics -> {metrics_path}")
    print("\n".join(lines))
