"""`rollgym orchestrate CONFIG.yaml --registry-file stack.json --output DIR`: step folders for a trainer elsewhere."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .common import UsageError, env_registry


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "orchestrate", help="stream training batches of a running stack into step folders for an external trainer",
        description="Runs the async RL orchestrator (docs/trainers.md, section 5b) against a running stack and "
                    "publishes each step's batch as OUTPUT/steps/step_N/ (batch.jsonl, meta.json, READY written "
                    "last). The trainer writes the path of the adapter it trained to step_N/ADAPTER; it is "
                    "hot-loaded on every model server before later steps generate. Run it again on the same "
                    "output to resume.")
    parser.add_argument("config", help="the orchestrator config YAML (batch_size, rollouts_per_example, envs, ...)")
    parser.add_argument("--registry-file", help="the running stack (written by `rollgym run --registry-file`); "
                                                "default: ROLLGYM_REGISTRY in a compose container")
    parser.add_argument("--output", required=True, help="the run's folder: steps/, history.jsonl, failures.jsonl")
    parser.add_argument("--poll-s", type=float, default=0.2, help="how often to look for the trainer's ADAPTER files")
    parser.add_argument("--no-wait", action="store_true", help="exit once the last step is published, without "
                                                               "waiting for the trainer to finish it")
    parser.set_defaults(handler=cmd_orchestrate)


def cmd_orchestrate(args: argparse.Namespace) -> int:
    import asyncio

    from ..client import load_registry_file
    from ..train.orchestrator import Orchestrator, OrchestratorError
    from ..train.orchestrator_config import load_orchestrator_config

    if args.poll_s <= 0:
        raise UsageError("--poll-s must be positive")
    try:
        config = load_orchestrator_config(args.config)
        registry = load_registry_file(args.registry_file) if args.registry_file else env_registry()
        if registry is None:
            raise UsageError("say which stack: --registry-file FILE (written by `rollgym run --registry-file`)")
        orchestrator = Orchestrator(config, registry, args.output, log=lambda m: print(m, file=sys.stderr))
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        asyncio.run(orchestrator.run_step_folders(poll_s=args.poll_s, wait_for_trainer=not args.no_wait))
    except OrchestratorError as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"rollgym: stopped; run the same command again to resume from {args.output}", file=sys.stderr)
        return 130
    print(f"published steps 1..{orchestrator.next_step - 1} in {orchestrator.folders.root}; "
          f"history: {orchestrator.output / 'history.jsonl'}")
    return 0
