"""`rollgym --help` and every command's `--help` print their help and exit 0 (argparse formats help strings
with %, so one stray percent sign turns a command's help into a traceback), and the CLI starts without
the web stack, the wire schema or the HTTP client: every command pays for what parsing its arguments imports."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from rollgym.cli import build_parser


def test_the_top_level_help_and_every_command_help_exit_0(capsys) -> None:
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # the registered subcommands, by name
    assert {"run", "collect-rollouts", "train", "eval", "export"} <= set(commands)
    for argv in [[], *([name] for name in commands)]:
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*argv, "--help"])
        assert exit_.value.code == 0, argv
        assert "usage:" in capsys.readouterr().out


def test_parsing_the_command_line_imports_no_heavy_library() -> None:
    heavy = ["fastapi", "openai", "aiohttp", "rollgym.schema", "torch"]
    code = ("import sys; from rollgym.cli import build_parser; build_parser().parse_args(['run', 'x.yaml']); "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_curriculum_help_states_the_curriculum_config_defaults() -> None:
    from rollgym.data.curriculum import CurriculumConfig

    commands = build_parser()._subparsers._group_actions[0].choices
    helps = {action.dest: action.help for action in commands["curriculum"]._actions}
    defaults = CurriculumConfig()
    for name in ("sort", "initial_percentile", "increment_percentile", "expansion_interval", "seed"):
        stated = re.search(r"default (\S+?)\)?$", helps[name])
        assert stated is not None and stated.group(1) == str(getattr(defaults, name)), (name, helps[name])
