"""`rollgym train PLAN.yaml [KEY=VALUE ...]`: run a training plan (rollgym.train)."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "train", help="run a training plan: epochs of collect, curate, optimize, apply, validate (resumable)")
    parser.add_argument("plan", help="the plan YAML (docs/trainers.md)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="plan keys to override, e.g. output=runs/x seed=1 stack.concurrency=2")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--rewind", type=int, metavar="N", help="continue the run in the plan's output from the end of "
                        "epoch (async: step) N; later ones are moved to OUTPUT/rewound/")
    parser.set_defaults(handler=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    import yaml

    from ..train.loop.epochs import TrainError, TrainLoop
    from ..train.loop.plan import PlanError, load_plan
    from ..train.loop.apply import ApplyError
    from .common import UsageError

    overrides: dict[str, Any] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"{item!r} must look like KEY=VALUE (e.g. seed=1)")
        try:
            overrides[key] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise UsageError(f"{item!r}: the value is not valid YAML ({problem})") from None
    try:
        plan = load_plan(args.plan, overrides)
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    if plan.mode == "async":
        from ..train.loop.async_driver import AsyncTrainLoop

        loop = AsyncTrainLoop(plan, progress=not args.no_progress, rewind_to=args.rewind)
    else:
        loop = TrainLoop(plan, progress=not args.no_progress, rewind_to=args.rewind)
    try:
        state = loop.run()
    except (TrainError, ApplyError) as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 1
    for line in loop.history():
        validation = line.get("validation") or {}
        train = line.get("train") or {}
        figures = []
        if train.get("mean_reward") is not None:
            figures.append(f"train reward {train['mean_reward']:.3f}")
        if validation.get("mean_reward") is not None:
            figures.append(f"validation reward {validation['mean_reward']:.3f}")
        if line.get("skipped"):
            figures.append("no training step (nothing to learn from)")
        unit = "step" if "step" in line else "epoch"
        print(f"{unit} {line['epoch']:>2}  {line.get('stage') or 'base':<10} {line.get('model_version') or '-':<14} "
              + ", ".join(figures))
    print(f"history: {loop.history_path}  plot: {loop.output / 'reward.png'}")
    if state.get("stopped"):
        print(f"stopped: {state['stopped']}")
    return 0
