"""Trainer-side data tools: `export`, `curriculum` and `prepare-data` (rollgym.data)."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from .common import UsageError


def register(commands: Any) -> None:
    _add_export(commands)
    _add_curriculum(commands)
    _add_prepare(commands)


def run_data_tool(args: argparse.Namespace) -> int:
    """The data module's `command(args)`; its DataError is a usage error."""
    from ..data.export import DataError

    module = importlib.import_module(f"..data.{args.data_module}", __package__)
    try:
        return module.command(args)
    except DataError as exc:
        raise UsageError(str(exc)) from None


def _add_export(commands: Any) -> None:
    """Add `rollgym export` to the CLI's subparsers."""
    from ..data.export import FORMATS, HF_FORMATS

    parser = commands.add_parser("export", help="turn rollouts JSONL into SFT, DPO, GRPO or Hugging Face data")
    parser.add_argument("--input", required=True, help="rollouts JSONL written by collect-rollouts")
    parser.add_argument("--output", required=True, help="output JSONL (a folder for --format hf)")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--hf-format", choices=HF_FORMATS, default="sft", help="records saved by --format hf (default sft)")
    parser.add_argument("--min-reward", type=float, help="sft: keep rollouts with reward >= this")
    parser.add_argument("--min-diff", type=float, default=0.1, help="dpo: least reward difference of a pair (default 0.1)")
    parser.add_argument("--min-reward-diff", type=float, default=0.0,
                        help="grpo: drop groups whose max-min reward is below this; groups with no spread "
                             "at all are always dropped (default 0.0)")
    parser.set_defaults(handler=run_data_tool, data_module="export")


def _add_curriculum(commands: Any) -> None:
    """Add `rollgym curriculum` to the CLI's subparsers.

    Options left out keep CurriculumConfig's defaults (not read here: parsing imports no pydantic)."""
    keep = argparse.SUPPRESS
    parser = commands.add_parser("curriculum", help="keep the rollout groups a curriculum trains on at an epoch")
    parser.add_argument("--input", required=True, help="rollouts JSONL written by collect-rollouts")
    parser.add_argument("--output", required=True, help="the selected groups' rollouts, JSONL")
    parser.add_argument("--epoch", type=int, required=True, help="the training epoch, from 0")
    parser.add_argument("--sort", choices=("easy_to_hard", "hard_to_easy"), default=keep,
                        help="default easy_to_hard")
    # Unlike a training plan's curriculum (0.1), the command keeps groups without a reward spread unless
    # asked: it selects from any rollouts file, deterministic environments' included.
    parser.add_argument("--min-reward-diff", type=float, default=0.0,
                        help="keep groups whose max-min reward is at least this (default 0.0: all)")
    parser.add_argument("--initial-percentile", type=float, default=keep,
                        help="fraction of the groups kept at epoch 0 (default 0.3)")
    parser.add_argument("--increment-percentile", type=float, default=keep,
                        help="fraction added at each expansion (default 0.2)")
    parser.add_argument("--expansion-interval", type=int, default=keep, help="epochs between expansions (default 5)")
    parser.add_argument("--random-subsample", type=float, help="then keep this random fraction of the groups")
    parser.add_argument("--seed", type=int, default=keep, help="seed of --random-subsample (default 0)")
    parser.add_argument("--drop-solved", action="store_true", help="first drop groups whose rollouts all got reward >= 1")
    parser.add_argument("--drop-unsolved", action="store_true", help="first drop groups whose rollouts all got reward <= 0")
    parser.set_defaults(handler=run_data_tool, data_module="curriculum")


class _InputAction(argparse.Action):
    """--input PATH: appended as [path, agent]; an --agent right after it fills the agent."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        namespace.inputs = [*(namespace.inputs or []), [values, None]]


class _AgentAction(argparse.Action):
    """--agent NAME: for the --input just before it, or, before any --input, for every input."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        inputs = namespace.inputs or []
        if not inputs:
            if namespace.agent is not None:
                parser.error("argument --agent: given twice before any --input")
            namespace.agent = values
            return
        if inputs[-1][1] is not None:
            parser.error(f"argument --agent: --input {inputs[-1][0]} already has --agent {inputs[-1][1]}")
        namespace.inputs = [*inputs[:-1], [inputs[-1][0], values]]


def _add_prepare(commands: Any) -> None:
    """Add `rollgym prepare-data` to the CLI's subparsers."""
    parser = commands.add_parser("prepare-data", help="validate task rows, stamp their agent_ref, split train/validation")
    parser.add_argument("--input", dest="inputs", action=_InputAction, required=True, metavar="PATH",
                        help="tasks JSONL or a saved Hugging Face dataset folder; repeat for more inputs")
    parser.add_argument("--agent", action=_AgentAction, metavar="NAME",
                        help="the agent of the --input just before it; before any --input, of every input "
                             "(default: the row's agent_ref, else the agent of the one environment the row fits)")
    parser.add_argument("--config", nargs="+", required=True, metavar="CONFIG_OR_OVERRIDE",
                        help="the stack's config files and key.path=value overrides (no server is started)")
    parser.add_argument("--output-dir", required=True, help="writes train.jsonl and validation.jsonl here")
    parser.add_argument("--validation-fraction", type=float, default=0.1, help="share of rows for validation (default 0.1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/validation hash")
    parser.set_defaults(handler=run_data_tool, data_module="prepare", agent=None)
