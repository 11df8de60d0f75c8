"""What `/verify` runs in the sandboxes, and how it reads what comes back. No HTTP, no sandbox calls.

- `diff_script`: the model's patch = the task's base tree against the workspace's files, whatever the model
  did to git (commits, a new `.git`, none at all): git runs with the *template's* repository, shown
  read-only, as its `GIT_DIR`, and an index and object store in the command's private input folder, so
  nothing in the workspace's `.git` is read.
- `grade_script`: in a fresh copy of the base, apply the graded part of the patch (patch.graded_part),
  then the task's `test_patch`, then run the tests with `pytest_runner.py`, whose report (fd 3) carries a
  one-time key given on stdin.
- `read_report`: the report line with that key, or why there is none.
"""

from __future__ import annotations

import base64
import json
import secrets
import shlex
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).resolve().with_name("pytest_runner.py")
REPORT_MARK = "ROLLGYM-REPORT"
# git with nothing of the user's, the system's or the workspace's configuration; the template's repository
# belongs to the server's user, hence safe.directory.
GIT_ENV = ("export GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null HOME=\"$SANDBOX_INPUT\" "
           "GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=safe.directory GIT_CONFIG_VALUE_0='*'\n")
PYTEST_PROGRAMS = (("python", "-m", "pytest"), ("python3", "-m", "pytest"), ("pytest",), ("py.test",))


class TestCommandError(ValueError):
    """A test command the grader cannot run through its own runner."""


def parse_test_cmd(command: str) -> tuple[dict[str, str], list[str]]:
    """`[NAME=value ...] python -m pytest ARGS` (or `pytest ARGS`) -> (environment, ARGS)."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise TestCommandError(f"cannot be split into words: {exc}") from None
    env: dict[str, str] = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    for program in PYTEST_PROGRAMS:
        if tuple(words[:len(program)]) == program:
            return env, words[len(program):]
    raise TestCommandError("must be a pytest command: [NAME=value ...] python -m pytest [options]")


def diff_script(base_git: str, max_bytes: int) -> str:
    """Prints `size N` then the patch (base tree -> /workspace's files), or `too_large N` alone."""
    git = shlex.quote(base_git)
    return (GIT_ENV +
            f"export GIT_DIR={git} GIT_WORK_TREE=/workspace GIT_INDEX_FILE=\"$SANDBOX_INPUT/index\" "
            f"GIT_OBJECT_DIRECTORY=\"$SANDBOX_INPUT/objects\" GIT_ALTERNATE_OBJECT_DIRECTORIES={git}/objects\n"
            "cd /workspace || exit 7\n"
            "mkdir -p \"$GIT_OBJECT_DIRECTORY\" || exit 7\n"
            "git read-tree HEAD || exit 7\n"
            # -f: files .gitignore'd are the model's changes too (the template was committed with -f)
            "git add -A -f -- . >/dev/null || exit 7\n"
            # a repository nested in the workspace is not part of the patch (git would record a bare gitlink)
            "git diff --cached --binary --full-index --no-renames --no-ext-diff --no-textconv --ignore-submodules=all HEAD "
            "> \"$SANDBOX_INPUT/patch\" || exit 7\n"
            "size=$(stat -c %s \"$SANDBOX_INPUT/patch\")\n"
            f"if [ \"$size\" -gt {int(max_bytes)} ]; then echo \"too_large $size\"; exit 0; fi\n"
            "echo \"size $size\"\n"
            "base64 -w 0 \"$SANDBOX_INPUT/patch\"\n")  # any bytes, carried exactly


def read_diff(stdout: str) -> tuple[bytes | None, str | None]:
    """(patch, None) or (None, why it could not be taken)."""
    head, _, body = stdout.partition("\n")
    kind, _, size = head.partition(" ")
    if kind == "too_large":
        return None, f"patch_too_large: {size} bytes"
    if kind != "size" or not size.isdigit():
        return None, "patch_unreadable"
    try:
        patch = base64.b64decode(body.strip(), validate=True)
    except ValueError:
        return None, "patch_unreadable: output cut short"
    if len(patch) != int(size):
        return None, "patch_unreadable: output cut short"
    return patch, None


def diff_output_bytes(max_bytes: int) -> int:
    return max_bytes * 4 // 3 + 4096


def new_key() -> str:
    return secrets.token_hex(16)


def grade_script(env: dict[str, str], args: list[str], tests: list[str], has_test_patch: bool) -> str:
    """Apply the graded patch and test_patch (a line `not_applied: model|test` when one does not apply: an exit
    status alone could come from the tests), then run the tests."""
    clean_env = ["PATH=\"$PATH\"", "LANG=C.UTF-8", "HOME=\"$SANDBOX_INPUT/home\"", "TMPDIR=/tmp",
                 "PYTHONDONTWRITEBYTECODE=1", "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1", "COLUMNS=200"]
    clean_env += [f"{name}={shlex.quote(value)}" for name, value in env.items() if name != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"]
    argv = " ".join(shlex.quote(word) for word in [*args, *tests])
    script = [GIT_ENV, "cd /workspace || exit 7", "mkdir -p \"$SANDBOX_INPUT/home\"",
              "if [ -s \"$SANDBOX_INPUT/model.patch\" ]; then",
              "  git apply --whitespace=nowarn \"$SANDBOX_INPUT/model.patch\" 2>&1 | tail -c 2000 >&2",
              "  [ \"${PIPESTATUS[0]}\" = 0 ] || { echo 'not_applied: model'; exit 3; }",
              "fi"]
    if has_test_patch:
        script += ["git apply --whitespace=nowarn \"$SANDBOX_INPUT/test.patch\" 2>&1 | tail -c 2000 >&2",
                   "[ \"${PIPESTATUS[0]}\" = 0 ] || { echo 'not_applied: test'; exit 4; }"]
    script += [f"env -i {' '.join(clean_env)} python -I -B \"$SANDBOX_INPUT/runner.py\" {argv} "
               "3>\"$SANDBOX_INPUT/report\" >\"$SANDBOX_INPUT/log\" 2>&1",
               "status=$?",
               "cat \"$SANDBOX_INPUT/report\"",
               "tail -c 3000 \"$SANDBOX_INPUT/log\" >&2",
               "exit $status"]
    return "\n".join(script) + "\n"


def runner_source() -> str:
    return RUNNER.read_text()


def read_report(stdout: str, key: str) -> dict[str, Any] | None:
    """The runner's report: the line that starts with the mark and this run's key; None without one."""
    prefix = f"{REPORT_MARK} {key} "
    for line in stdout.splitlines():
        if line.startswith(prefix):
            try:
                report = json.loads(line[len(prefix):])
            except ValueError:
                return None
            return report if isinstance(report, dict) and isinstance(report.get("tests"), dict) else None
    return None


def log_reason(log: str) -> str:
    """The last error a log shows (a SyntaxError, ImportError, ...), in one line, for a verdict's reason."""
    for line in reversed(log.splitlines()):
        stripped = line.strip().lstrip("E").strip()
        if stripped.split(":", 1)[0].endswith(("Error", "Exception", "Exit", "Interrupted")):
            return stripped[:300]
    return ""
