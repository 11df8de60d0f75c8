"""Make SWE-style tasks from pure-Python libraries on PyPI and their own test suites.

    python -m resources_servers.swe.generate --per-library 16 --out resources_servers/swe/data/generated

For each library of the libraries file (data/libraries.jsonl): its pinned sdist becomes a repository (repos.py); its test suite
runs once clean; then bugs are injected one at a time (mutate.py: flip an operator, drop a branch,
change a constant, swap arguments; the kinds taken in turn, sites in a seeded order) and the suite
runs again. A bug is kept when at least one passing test fails and the run ended by itself. Its task:
the repository with the bug committed (`base_commit`), the fix as `patch`, the tests it broke as
`FAIL_TO_PASS`, the other passing tests of the same test files as `PASS_TO_PASS`, and an issue text
written from the failing tests (their names and pytest's messages; never the bug's place). A bug whose
fix can be read in a copy of the library in the toolchain (a vendored copy, leaks.py) is refused; copies
in the serving machine's system folders are hidden by the server at serve time. Tasks are
split into train and validation by a hash of their id. Every run is made twice: a test that does
not pass both clean runs is left out, and a bug whose two runs break different tests is dropped
(a random-replacement cache's tests pass or fail by chance). `validate.py` then checks every task in the
environment's sandbox (the gold patch resolves it; the repository as given does not).

The mutants' test runs here are plain subprocesses with a timeout (the library's own tests, from
PyPI); what a model writes only ever runs in the environment's sandbox.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from .app import tool_schemas
from .leaks import solution_copies, toolchain_roots
from .mutate import KINDS, Mutation, mutations
from .repos import (DEFAULT_CACHE, DEFAULT_REPOS, LIBRARIES_FILE, Library, RepoError, clean_repo, commit_task, git,
                    load_libraries)
from .testlog import GOOD, failure_messages, parse_pytest

DEFAULT_OUT = Path(__file__).resolve().parent / "data" / "generated"
TOOLCHAIN_PYTHON = sys.executable
INSTRUCTIONS = (
    "You are working in a Python repository checked out at /workspace. Fix the issue below by editing the "
    "library's source (not its tests). Use the `bash` tool to explore and run commands (the repository's "
    "tests run with `python -m pytest`), `str_replace_editor` to view and edit files, and call `submit` "
    "when you are done.\n\n"
)


def run_tests(workdir: Path, lib: Library, targets: list[str], timeout_s: float = 120.0) -> tuple[dict[str, str], str, bool]:
    """(outcomes, log, finished) of the library's test command over `targets` in `workdir`."""
    env = {"PATH": f"{os.path.dirname(TOOLCHAIN_PYTHON)}:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(workdir),
           "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "240"}  # the summary's messages, less cut
    command = f"{lib.test_cmd} {' '.join(targets)}"
    try:
        done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {}, "", False
    log = done.stdout + done.stderr
    return parse_pytest(log), log, True


def test_file(test: str) -> str:
    return test.split("::", 1)[0]


def issue_text(lib: Library, failing: list[str], messages: dict[str, str]) -> str:
    """An issue a user could have filed: what fails, with pytest's words, and nothing about where."""
    shown = failing[:8]
    lines = [f"Tests of {lib.name} {lib.version} fail", "",
             f"After checking out the repository, {len(failing)} test{'s' if len(failing) != 1 else ''} of its own "
             f"suite fail{'' if len(failing) != 1 else 's'}:", ""]
    lines += [f"- `{test}`" + (f": {messages[test][:200]}" if test in messages else "") for test in shown]
    if len(failing) > len(shown):
        lines.append(f"- ... and {len(failing) - len(shown)} more")
    lines += ["", f"Run them with `{lib.test_cmd.split(' python', 1)[0]} python -m pytest "
                  f"{' '.join(shlex.quote(t) for t in shown[:2])}`.",
              "They passed before; please find the regression and fix it without breaking the other tests."]
    return "\n".join(lines)


def interleaved(lib: Library, root: Path, seed: int) -> list[tuple[str, Mutation]]:
    """Every mutation of the library's modules, the kinds taken in turn, each kind's sites shuffled."""
    by_kind: dict[str, list[tuple[str, Mutation]]] = defaultdict(list)
    for module in lib.modules:
        for mutation in mutations((root / module).read_text()):
            by_kind[mutation.kind].append((module, mutation))
    rng = random.Random(f"{lib.name}-{seed}")
    for items in by_kind.values():
        rng.shuffle(items)
    ordered = []
    while any(by_kind.values()):
        for kind in KINDS:
            if by_kind.get(kind):
                ordered.append(by_kind[kind].pop())
    return ordered


def generate_library(lib: Library, count: int, repos: Path, cache: Path, seed: int = 0,
                     max_tries: int = 200, log=print) -> list[dict[str, Any]]:
    repo, clean = clean_repo(lib, repos, cache)
    work = Path(tempfile.mkdtemp(prefix=f"rollgym-gen-{lib.name}-"))
    try:
        shutil.rmtree(work)
        git(repo.parent, "clone", "-q", str(repo), str(work))
        git(work, "checkout", "-q", "--detach", clean)
        base, _, finished = run_tests(work, lib, [])
        again, _, finished_again = run_tests(work, lib, [])
        # Only tests that pass twice count: a flaky test would make a task that grades by chance.
        passing = {t for t, o in base.items() if o in GOOD and again.get(t) in GOOD}
        finished = finished and finished_again
        if not finished or not passing:
            raise RuntimeError(f"{lib.name}: its clean test suite does not run here")
        log(f"{lib.name} {lib.version}: {len(passing)} tests pass clean")
        rows: list[dict[str, Any]] = []
        seen_functions: dict[str, int] = defaultdict(int)
        tried = 0
        for module, mutation in interleaved(lib, work, seed):
            if len(rows) >= count or tried >= max_tries:
                break
            if seen_functions[f"{module}:{mutation.function}"] >= 2:
                continue  # spread the bugs over the library
            tried += 1
            original = (work / module).read_text()
            (work / module).write_text(mutation.source)
            try:
                after, output, finished = run_tests(work, lib, [], timeout_s=60)
                broken = sorted(t for t in passing if after.get(t) not in GOOD)
                if finished and broken:  # the same tests must fail again: no bug found by chance
                    repeat, _, finished = run_tests(work, lib, [], timeout_s=60)
                    finished = finished and broken == sorted(t for t in passing if repeat.get(t) not in GOOD)
                fix = git(work, "diff", "-R", "--src-prefix=b/", "--dst-prefix=a/")  # buggy -> clean, as a/ b/
            finally:
                (work / module).write_text(original)
            if not finished or not broken or len(broken) == len(passing):
                continue
            copies = solution_copies(fix, toolchain_roots(sys.prefix))
            if copies:  # the sandbox shows the toolchain: a copy of the fix there is the answer, readable
                log(f"  refused ({mutation.kind} in {mutation.function}): its fix is readable in {copies[0]}")
                continue
            files = {test_file(t) for t in broken}
            keep = sorted(t for t in passing - set(broken) if test_file(t) in files)
            digest = hashlib.sha256(fix.encode()).hexdigest()[:8]
            instance_id = f"pypi__{lib.name}-{lib.version}.{mutation.kind}__{digest}"
            base_commit = commit_task(repo, clean, instance_id, fix)
            statement = issue_text(lib, broken, failure_messages(output))
            rows.append({
                "instance_id": instance_id, "repo": lib.repo, "version": lib.version, "base_commit": base_commit,
                "environment_setup_commit": clean, "created_at": "2026-01-01T00:00:00Z",
                "problem_statement": statement, "hints_text": "", "patch": fix, "test_patch": "",
                "FAIL_TO_PASS": broken, "PASS_TO_PASS": keep, "test_cmd": lib.test_cmd,
                "mutation": {"kind": mutation.kind, "file": module, "line": mutation.line, "function": mutation.function},
                "responses_create_params": {"input": [{"role": "user", "content": INSTRUCTIONS + statement}],
                                            "tools": tool_schemas()},
            })
            seen_functions[f"{module}:{mutation.function}"] += 1
            log(f"  {instance_id}: {mutation.kind} in {mutation.function} breaks {len(broken)}")
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)


def split_of(instance_id: str, validation_share: float) -> str:
    bucket = int(hashlib.sha256(instance_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return "validation" if bucket < validation_share else "train"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="SWE-style tasks from PyPI libraries by bug injection")
    parser.add_argument("--library-file", default=str(LIBRARIES_FILE), help="the libraries file (JSONL)")
    parser.add_argument("--libraries", nargs="+", help="names from the libraries file (default: all)")
    parser.add_argument("--per-library", type=int, default=16)
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="folder for train.jsonl and validation.jsonl")
    parser.add_argument("--repos", default=str(DEFAULT_REPOS))
    parser.add_argument("--cache", default=str(DEFAULT_CACHE))
    parser.add_argument("--validation-share", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        libraries = load_libraries(args.library_file)
    except (RepoError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    unknown = sorted(set(args.libraries or ()) - set(libraries))
    if unknown:
        print(f"error: --libraries: {unknown[0]!r} is not in {args.library_file}", file=sys.stderr)
        return 2
    args.libraries = args.libraries or sorted(libraries)
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    for name in args.libraries:
        rows += generate_library(libraries[name], args.per_library, Path(args.repos), Path(args.cache), args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "validation": []}
    for row in sorted(rows, key=lambda r: r["instance_id"]):
        splits[split_of(row["instance_id"], args.validation_share)].append(row)
    for name, split_rows in splits.items():
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in split_rows))
    print(f"{len(rows)} tasks from {len(args.libraries)} libraries in {time.monotonic() - started:.0f} s: "
          f"{len(splits['train'])} train, {len(splits['validation'])} validation in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
