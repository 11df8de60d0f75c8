"""The command line of the training loop: `rollgym train PLAN.yaml [key=value ...]`."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import yaml


def register(commands: Any, handler: Callable[[argparse.Namespace], int]) -> None:
    """Add `rollgym train` to the CLI's subparsers."""
    parser = commands.add_parser(
        "train", help="run a training plan: epochs of collect, curate, optimize, apply, validate (resumable)")
    parser.add_argument("plan", help="the plan YAML (docs/trainers.md)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="top-level plan keys to override, e.g. output=runs/x seed=1")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(handler=handler)


def command(args: argparse.Namespace) -> int:
    from .loop import TrainError, TrainLoop
    from .plan import PlanError, load_plan

    overrides: dict[str, Any] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"rollgym: error: {item!r} must look like KEY=VALUE (e.g. seed=1)", file=sys.stderr)
            return 2
        overrides[key] = yaml.safe_load(value)
    try:
        plan = load_plan(args.plan, overrides)
    except PlanError as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 2
    try:
        state = TrainLoop(plan, progress=not args.no_progress).run()
    except TrainError as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 1
    loop = TrainLoop(plan, progress=False)
    for line in loop.history():
        validation = line.get("validation") or {}
        train = line.get("train") or {}
        figures = []
        if train.get("mean_reward") is not None:
            figures.append(f"train reward {train['mean_reward']:.3f}")
        if validation.get("mean_reward") is not None:
            figures.append(f"validation reward {validation['mean_reward']:.3f}")
        print(f"epoch {line['epoch']:>2} {line.get('stage') or 'base':<12} {line.get('model_version') or '-':<16} "
              + ", ".join(figures))
    print(f"history: {loop.history_path}  plot: {loop.output / 'reward.png'}")
    if state.get("stopped"):
        print(f"stopped: {state['stopped']}")
    return 0


__all__ = ["command", "register"]
