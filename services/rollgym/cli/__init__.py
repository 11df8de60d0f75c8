"""The `rollgym` command line: one module per command group, argparse only here.

Each group's handlers import what they run when they run, so `rollgym --help` and
`import rollgym.cli` load no web stack.
"""

from __future__ import annotations

from .common import STARTED, UsageError  # first: STARTED times the start-up honestly

import argparse  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

from . import adapters, collect, data, envkit, eval, orchestrate, stack, train, view  # noqa: E402

__all__ = ["STARTED", "UsageError", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollgym", description="Rollouts and rewards for RL of LLM agents.")
    commands = parser.add_subparsers(dest="command", required=True)
    stack.register(commands)  # run, serve-one, compose
    collect.register(commands)  # collect-rollouts
    envkit.register(commands)  # test, init, env list, check-tokens
    data.register(commands)  # export, curriculum, prepare-data
    adapters.register(commands)  # adapters load|unload|list
    view.register(commands)  # view
    train.register(commands)  # train
    orchestrate.register(commands)  # orchestrate
    eval.register(commands)  # eval
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `rollgym train PLAN --check seed=1`: argparse ends the positional list at the option, so overrides
    # after one come back unparsed; they are overrides all the same.
    if extra and isinstance(getattr(args, "overrides", None), list) and not any(a.startswith("-") for a in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from ..errors import ConfigError, LaunchError
    from ..stack.limits import raise_open_file_limit

    raise_open_file_limit()
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        # A background job of a script starts with SIGINT ignored, and Python keeps it ignored: every
        # long command (train, orchestrate, collect-rollouts, eval) would then go on through Ctrl-C or
        # `kill -INT`, which should stop it cleanly (a collection resumes where it stopped).
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
