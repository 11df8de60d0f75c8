"""`rollgym train PLAN.yaml [KEY=VALUE ...]`: run a training plan (rollgym.train); `--check` validates it and
says where a run in its output folder would continue, starting nothing."""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(commands: Any) -> None:
    parser = commands.add_parser(
        "train", help="run a training plan: epochs of collect, curate, optimize, apply, validate (resumable)")
    parser.add_argument("plan", help="the plan YAML (docs/train-loop.md)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="plan keys to override, e.g. output=runs/x seed=1 stack.concurrency=2")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--rewind", type=int, metavar="N", help="continue the run in the plan's output from the end of "
                        "epoch (async: step) N; later ones are moved to OUTPUT/rewound/")
    parser.add_argument("--check", action="store_true", help="validate the plan (keys, files, temperatures, trainer "
                        "and apply) and whether its output folder can be resumed, listing every problem; exit 0 or "
                        "2, starting nothing")
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
        if args.check:
            return _report_problems(args.plan, str(exc).splitlines())
        raise UsageError(str(exc)) from None
    from ..train.loop.preflight import preflight

    found = preflight(plan)  # sources reachable and not empty, data files, ports: before anything starts
    problems = [f"{args.plan}: key '{key}': {message}" for key, message in found.problems]
    if args.check:
        return check_output(args.plan, plan, args.rewind, problems, found.counts)
    if problems:  # the cause first, and no output folder made
        raise UsageError("\n".join(problems) if len(problems) == 1 else
                         f"{args.plan}: {len(problems)} problems; nothing started\n" + "\n".join(problems))
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
        for name, own in (validation.get("policies") or {}).items():  # several policies: each one's own figure
            if own.get("mean_reward") is not None:
                figures.append(f"{name} {own['mean_reward']:.3f}")
        unit = "step" if "step" in line else "epoch"
        print(f"{unit} {line['epoch']:>2}  {line.get('stage') or 'base':<10} {line.get('model_version') or '-':<14} "
              + ", ".join(figures))
    print(f"history: {loop.history_path}  plot: {loop.output / 'reward.png'}")
    if state.get("stopped"):
        print(f"stopped: {state['stopped']}")
    return 0


def _report_problems(source: str, problems: list[str]) -> int:
    print(f"{source}: {len(problems)} problem{'s' if len(problems) != 1 else ''}; nothing started", file=sys.stderr)
    for problem in problems:
        print(f"  {problem}", file=sys.stderr)
    return 2


def check_output(source: str, plan: Any, rewind: int | None = None, problems: list[str] | None = None,
                 counts: list[tuple[str, str]] | None = None) -> int:
    """`--check` of a plan that loaded: whether its output folder would be claimed, and where a run there
    continues; 0 and what would run (with what each source and data file holds: `counts`), or 2 and every
    problem (`problems`: the preflight's, before the folder's). Reads the folder, never writes it."""
    from pathlib import Path

    from ..train.loop.run_folder import PLAN_FILE, RunFolder

    unit = "step" if plan.mode == "async" else "epoch"
    folder = RunFolder(Path(plan.output), unit)
    problems = list(problems or [])
    refusal = folder.refusal(plan.model_dump(mode="json"))
    if refusal is not None:
        problems.append(f"key 'output': {refusal.removeprefix('output: ')}")
    elif plan.mode == "async" and folder.holds_other_files():
        problems.append(f"key 'output': {folder.root} is not empty and holds no run (no {PLAN_FILE}); "
                        "use another output folder")
    history = folder.history() if refusal is None and folder.holds_run() else []
    finished = sorted({int(line["epoch"]) for line in history if "epoch" in line})
    if rewind is not None and refusal is None and (problem := folder.rewind_problem(rewind,
                                                                                   plan.checkpoints.keep_last)):
        problems.append(f"--rewind {rewind}: {problem}")
    if problems:
        return _report_problems(source, problems)
    print(f"{source}: ok ({_shape(plan)})")
    for key, held in counts or []:
        print(f"  {key}: {held}")
    print(f"output {plan.output}: {_resume_point(plan, folder, finished, rewind)}")
    return 0


def _shape(plan: Any) -> str:
    if plan.mode == "async":
        assert plan.optimize is not None and plan.orchestrator is not None
        return (f"mode async, trainer {plan.optimize.trainer}, "
                f"{plan.orchestrator.max_steps or 'unbounded'} steps")
    stages = ", ".join(f"{stage.name}: {stage.epochs} x {stage.optimize.trainer}, apply {stage.apply}"
                       for stage in plan.stages)
    return f"mode epochs, {len(plan.epochs())} epochs; {stages}"


def _resume_point(plan: Any, folder: Any, finished: list[int], rewind: int | None) -> str:
    """Where `rollgym train` would start in the folder (claim accepted it)."""
    from ..train.loop.run_folder import read_json

    if not folder.holds_run():
        return "a new run"
    state = read_json(folder.unit_dir(rewind) / "state.json", {}) if rewind is not None else folder.read_state()
    done = set(finished if rewind is None else [n for n in finished if n <= rewind])
    head = f"holds a run of this plan, {_count(len(done - {0}), plan.mode)} finished"
    if rewind is not None:
        head += f" after the rewind to {folder.unit} {rewind}"
    elif state.get("stopped"):
        return f"{head}; it stopped ({state['stopped']}): nothing to run (--rewind N continues it from {folder.unit} N)"
    applied = (state.get("applied") or {}).get("version")
    again = f"; applies {applied} again" if applied else ""
    if plan.validation is not None and 0 not in done:
        return f"{head}{again}; continues with {folder.unit} 0 (the base model's validation)"
    if plan.mode == "async":
        steps = len(done - {0})
        return f"{head}{again}; continues with step {steps + 1} of {plan.orchestrator.max_steps or 'unbounded'}"
    remaining = [(epoch, stage) for epoch, stage in plan.epochs() if epoch not in done]
    if not remaining:
        return f"{head}: every epoch of the plan is finished, nothing to run"
    epoch, stage = remaining[0]
    phases = [] if rewind is not None else list(read_json(folder.unit_dir(epoch) / "phases.json", {}))
    within = f", its {', '.join(phases)} phase{'s' if len(phases) > 1 else ''} already done" if phases else ""
    return f"{head}{again}; continues with epoch {epoch} (stage {stage.name}){within}"


def _count(n: int, mode: str) -> str:
    unit = "step" if mode == "async" else "epoch"
    return f"{n} {unit}{'s' if n != 1 else ''}"
