"""`rollgym eval`: run a suite's environments against models and adapters, report mean reward, pass@k and
95 % intervals side by side, and which differences are beyond noise (rollgym.eval)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from .common import STARTED, UsageError, parse_params


def register(commands: Any) -> None:
    run = commands.add_parser(
        "eval", help="evaluate models/adapters on environments: mean reward, pass@k, 95%% CI, comparisons",
        description="Runs every environment of a suite (or --env NAME ...) against every --model through the "
                    "rollout collector, into OUTPUT/ENV/MODEL.jsonl (rerunning resumes), and reports per "
                    "environment and model the mean reward with a 95% score interval over tasks, unbiased "
                    "pass@k and failures counted apart, also per task source in a mixture (e.g. each "
                    "reasoning-gym generator); --compare A B says which differences are beyond noise. "
                    "docs/eval.md")
    run.add_argument("suite", nargs="?", help="a suite YAML file, or a bundled suite's name (evals/NAME.yaml)")
    run.add_argument("--env", action="append", metavar="NAME",
                     help="an environment folder resources_servers/NAME (its example tasks); with a suite: "
                          "only this environment of it (repeatable)")
    run.add_argument("--model", action="append", metavar="MODEL",
                     help="base (the served base model), a name the model server serves, an adapter path, or "
                          "LABEL=ADAPTER_PATH (hot-loaded); repeatable; default: base")
    run.add_argument("--run", metavar="TRAIN_OUTPUT",
                     help="also every version of a `rollgym train` run: its base (epoch-0) and each epoch's adapter")
    run.add_argument("--output", help="the output folder (default runs/eval-SUITE); rerunning resumes")
    where = run.add_mutually_exclusive_group()
    where.add_argument("--config", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                       help="more of the stack the run starts: a model config and key=value overrides, e.g. "
                            "models/chat_completions/configs/chat_completions.yaml policy_model.base_url=...")
    where.add_argument("--registry-file", help="use a running stack (`rollgym run --registry-file`) that has the "
                                               "environments' agents")
    run.add_argument("--model-server", default="policy_model", help="the model server the models are on")
    run.add_argument("--repeats", type=int, help="rollouts per task (overrides the suite)")
    run.add_argument("--limit", type=int, help="the first N tasks of each environment (overrides the suite)")
    run.add_argument("--concurrency", type=int, help="rollouts in flight (overrides the suite)")
    run.add_argument("--pass-threshold", type=float, help="reward that counts as a pass (overrides the suite)")
    run.add_argument("--param", action="append", metavar="KEY=JSON",
                     help="set a responses_create_params key on every task, e.g. temperature=0")
    run.add_argument("--timeout", type=float, help="seconds one attempt of a rollout may take")
    run.add_argument("--max-attempts", type=int, help="tries per rollout on infrastructure failure")
    run.add_argument("--compare", nargs=2, action="append", metavar=("A", "B"),
                     help="report B - A per environment, paired over tasks, and whether it is beyond noise "
                          "(repeatable; default: every model against the first)")
    run.add_argument("--format", choices=("table", "markdown", "json"), default="table",
                     help="what to print (report.json and report.md are always written)")
    run.add_argument("--report", metavar="OUTPUT", help="only render the report of an earlier run's folder")
    run.add_argument("--no-progress", action="store_true", help="no progress bars")
    run.set_defaults(handler=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from ..eval.models import ModelUnreachable
    from ..eval.suite import SuiteError

    try:
        if args.report:
            return _report_only(args)
        return _evaluate(args)
    except SuiteError as exc:
        raise UsageError(str(exc)) from None
    except ModelUnreachable as exc:
        print(f"rollgym: error: {exc}", file=sys.stderr)
        return 1


def _report_only(args: argparse.Namespace) -> int:
    from ..eval.report import MANIFEST, write_report

    output = Path(args.report)
    if not (output / MANIFEST).is_file():
        raise UsageError(f"--report {output}: no {MANIFEST} (not the output folder of `rollgym eval`)")
    report = _build(output, args)
    write_report(output, report)
    _print(report, args.format)
    return 0


def _build(output: Path, args: argparse.Namespace) -> dict[str, Any]:
    import orjson

    from ..eval.report import MANIFEST, build_report

    labels = [model["label"] for model in orjson.loads((output / MANIFEST).read_bytes())["models"]]
    for pair in args.compare or []:
        for label in pair:
            if label not in labels:
                raise UsageError(f"--compare {label}: not a model of this run (models: {', '.join(labels)})")
    return build_report(output, [tuple(pair) for pair in args.compare] if args.compare else None)


def _evaluate(args: argparse.Namespace) -> int:
    import asyncio

    from ..config import load_stack, split_configs
    from ..eval import models as eval_models
    from ..eval.report import write_report
    from ..eval.runner import RunOptions, check_manifest, collect_all, write_manifest
    from ..eval.suite import find_suite, folder_environment, load_suite, stack_files, suite_environments

    for option in ("repeats", "limit", "concurrency", "max_attempts"):
        value = getattr(args, option)
        if value is not None and value < 1:
            raise UsageError(f"--{option.replace('_', '-')} must be at least 1, got {value}")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    params = parse_params(args.param or [])
    suite = None
    if args.suite:
        source = find_suite(args.suite)
        suite = load_suite(source)
        environments = suite_environments(suite, source, args.env)
        name = suite.name or source.stem
    elif args.env:
        environments = [folder_environment(env, 4, None, 1.0, {}) for env in dict.fromkeys(args.env)]
        name = None
    else:
        raise UsageError("say what to evaluate: a suite (rollgym eval smoke, or a YAML file) or --env NAME ...")
    for env in environments:
        env.repeats = args.repeats or env.repeats
        env.limit = args.limit or env.limit
        env.pass_threshold = env.pass_threshold if args.pass_threshold is None else args.pass_threshold
        env.params = {**env.params, **params}
    specs = [eval_models.parse_model(text) for text in args.model or []]
    if args.run:
        specs += eval_models.run_models(Path(args.run))
    specs = specs or [eval_models.ModelSpec(eval_models.BASE, name=eval_models.BASE)]
    eval_models.check_labels(specs)
    for pair in args.compare or []:
        for label in pair:
            if label not in [spec.label for spec in specs]:
                raise UsageError(f"--compare {label}: not one of the models ({', '.join(s.label for s in specs)})")
    output = Path(args.output or f"runs/eval-{name or '-'.join(env.name for env in environments)}")
    if output.exists() and not output.is_dir():
        raise UsageError(f"--output {output} is a file; the output of an evaluation is a folder")
    options = RunOptions(
        concurrency=args.concurrency or (suite.concurrency if suite else 4),
        timeout_s=args.timeout or (suite.timeout_s if suite else 600.0),
        max_attempts=args.max_attempts or (suite.max_attempts if suite else 2),
        progress=not args.no_progress,
    )

    def log(message: str) -> None:
        print(f"rollgym: {message}", file=sys.stderr)

    stack = None
    try:
        if args.registry_file:
            from ..client import load_registry_file

            try:
                registry = load_registry_file(args.registry_file)
            except ValueError as exc:
                raise UsageError(f"--registry-file: {exc}") from None
        else:
            files, overrides = stack_files(suite, environments)
            more_files, more_overrides = split_configs(args.config or [])
            from ..stack.launcher import Stack

            stack = Stack(load_stack([*more_files, *files], [*overrides, *more_overrides]))
            registry = stack.start()
            log(f"stack ready in {time.perf_counter() - STARTED:.2f} s")
        for env in environments:
            if env.agent not in registry:
                agents = [n for n, a in registry.items() if a.role in ("agents", "")]
                raise UsageError(f"environment {env.name}: the stack has no agent {env.agent!r} "
                                 f"(agents: {', '.join(agents) or 'none'})")
        started = time.perf_counter()

        async def evaluate() -> list[Any]:
            models, loaded = await eval_models.resolve_models(registry, args.model_server, specs, log)
            try:
                check_manifest(output, models)
                write_manifest(output, name, environments, models)
                await collect_all(registry, environments, models, output, options, log)
            finally:
                await eval_models.unload(registry, args.model_server, loaded)
            return models

        models = asyncio.run(evaluate())
        write_manifest(output, name, environments, models, wall_s=round(time.perf_counter() - started, 3))
    finally:
        if stack is not None:
            stack.stop()
    report = _build(output, args)
    write_report(output, report)
    _print(report, args.format)
    log(f"report -> {output / 'report.json'}, {output / 'report.md'} "
        f"(evaluated in {report['wall_s']:.1f} s)")
    empty = [f"{env['name']} × {label}" for env in report["environments"]
             for label, result in env["results"].items() if result["rollouts"] == 0]
    if empty:
        log(f"no rollout finished for {', '.join(empty)} (failures: see OUTPUT/ENV/MODEL.failures.jsonl): exit 1")
        return 1
    return 0


def _print(report: dict[str, Any], form: str) -> None:
    import json

    from ..eval.report import render_markdown, render_table

    if form == "json":
        print(json.dumps(report, indent=2))
    elif form == "markdown":
        print(render_markdown(report))
    else:
        print(render_table(report))
