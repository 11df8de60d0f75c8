"""Commands for environment authors: `test`, `init` and `check-tokens` (rollgym.envkit)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .common import UsageError


def register(commands: Any) -> None:
    test = commands.add_parser("test", help="a server folder's tests, then a live check of its server")
    test.add_argument("folders", nargs="*", metavar="FOLDER", help="e.g. resources_servers/weather")
    test.add_argument("--all", action="store_true", help="every folder under models/, agents/, resources_servers/")
    test.add_argument("--no-tests", action="store_true", help="only the live check")
    test.set_defaults(handler=run_test)

    init = commands.add_parser("init", help="scaffold a new environment folder that passes `rollgym test`")
    init.add_argument("folder", metavar="resources_servers/NAME | DIR",
                      help="the folder to write (with --package: the project folder; its name is the package's)")
    init.add_argument("--package", action="store_true", help="a pip-installable project (pyproject.toml with a "
                      "rollgym.environments entry point) instead of a folder of this checkout")
    init.set_defaults(handler=run_init)

    env = commands.add_parser("env", help="the environments a stack can use")
    actions = env.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every environment folder here, every installed environment "
                                 "package and every installed verifiers Env (with the config line that runs it "
                                 "through the proxy agent), with its tools and an example task")
    listing.add_argument("--json", action="store_true", help="one JSON object per environment")
    listing.set_defaults(handler=run_env_list)

    # check-tokens: multi-turn rollouts must extend their tokens exactly (rollgym.envkit.token_check).
    _add_check_tokens(commands)


def run_test(args: argparse.Namespace) -> int:
    from ..envkit.folder_check import check_folder, server_folders

    if args.all:
        folders = server_folders(Path.cwd())
        if not folders:
            raise UsageError("--all: no server folders here; run it from the repository root")
    elif args.folders:
        folders = [_folder_or_package(folder) for folder in args.folders]
    else:
        raise UsageError("name a server folder (e.g. resources_servers/weather) or pass --all")
    reports = [check_folder(folder, run_tests=not args.no_tests) for folder in folders]
    failed = [report for report in reports if not report.ok]
    partial = [report for report in reports if report.ok and report.skipped]
    print(f"{len(reports) - len(failed)} passed, {len(failed)} failed"
          + (f" ({len(partial)} passed with checks skipped)" if partial else ""))
    for report in partial:
        print(f"  checks skipped: {report.folder.parent.name}/{report.folder.name} (see its skip lines above)")
    for report in failed:
        print(f"  failed: {report.folder.parent.name}/{report.folder.name}")
    return 1 if failed else 0


def _folder_or_package(given: str) -> Path:
    """A server folder's path, or the name of an installed environment package (its folder)."""
    path = Path(given)
    if not path.exists() and "/" not in given:
        from ..envkit.packages import installed_environments

        installed = installed_environments().get(given)
        if installed is not None:
            return installed.path
    return path


def run_init(args: argparse.Namespace) -> int:
    from ..envkit.scaffold import scaffold, scaffold_package

    folder = Path(args.folder)
    try:
        written = scaffold_package(folder) if args.package else scaffold(folder)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for path in written:
        print(f"  wrote {path}")
    if args.package:
        print(f"next: edit {folder / folder.name}/app.py, `pip install -e {folder}`, then, from the rollgym "
              f"checkout, `rollgym test {folder.name}`")
    else:
        print(f"next: edit {args.folder}/app.py, then `rollgym test {args.folder}`")
    return 0


def run_env_list(args: argparse.Namespace) -> int:
    import orjson

    from ..envkit.packages import environment_cards, environment_problems

    cards = environment_cards(Path.cwd())
    if args.json:
        for card in cards:
            print(orjson.dumps(card.to_json()).decode())
    else:
        for card in cards:
            print(f"{card.name}  ({card.source}: {card.path})")
            if card.problem:
                print(f"  problem: {card.problem}")
                continue
            print(f"  {_clip(card.summary)}")
            print(f"  tools: {', '.join(card.tools) or 'none'}")
            if card.example:
                print(f"  example: {_clip(card.example)}")
            if card.config:
                print(f"  run by the proxy agent (reward: agent): {card.config}")
        print(f"{len(cards)} environments")
    problems = environment_problems()
    for problem in problems:
        print(f"rollgym: warning: {problem}", file=sys.stderr)
    return 0


def _clip(text: str, width: int = 110) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"


def run_check_tokens(args: argparse.Namespace) -> int:
    from ..envkit.token_check import CheckUsageError, command

    try:
        return command(args)
    except CheckUsageError as exc:
        raise UsageError(str(exc)) from None


def _add_check_tokens(commands: Any) -> None:
    check = commands.add_parser("check-tokens", help="check that multi-turn rollouts extend their tokens exactly")
    where = check.add_mutually_exclusive_group(required=True)
    where.add_argument("--config", nargs="+", metavar="CONFIG_OR_OVERRIDE", help="start this stack for the check")
    where.add_argument("--registry-file", help="use a running stack (written by `rollgym run --registry-file`)")
    check.add_argument("--agent", help="which agent of the stack (default: the only one)")
    check.add_argument("--model-server", help="the model server to decode with (default: the agent's)")
    check.add_argument("--input", help="tasks JSONL (default: the environment's data/example.jsonl)")
    check.add_argument("--rollouts", type=int, default=3, help="how many rollouts to check")
    check.add_argument("--max-output-tokens", type=int, default=128, dest="max_output_tokens",
                       help="token limit per model call (0: the task's own)")
    check.add_argument("--no-force-tool", action="store_true",
                       help="do not force the first tool call (it makes tool environments multi-turn)")
    check.add_argument("--strict", action="store_true",
                       help="also fail when re-tokenizing the final conversation gives other ids")
    check.add_argument("--timeout", type=float, default=600.0, help="seconds one rollout may take")
    check.add_argument("--json", dest="json_path", help="also write the report as JSON here")
    check.set_defaults(handler=run_check_tokens)
