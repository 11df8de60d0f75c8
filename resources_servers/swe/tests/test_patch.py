"""The grader's text functions: a git patch split per file (quoted names, kinds, binary parts), the rule of
what is left out of the graded copy, submit's count, the test command's form, and the runner's report
read only with this run's key."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resources_servers.swe import grader
from resources_servers.swe.leaks import hidden_paths, sandbox_roots, solution_copies
from resources_servers.swe.patch import describe, graded_part, left_out_because, split_patch, task_test_paths


@pytest.fixture(scope="module")
def real_patch(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A patch git itself wrote: a modified, an added, a deleted, a binary file and an odd name."""
    repo = tmp_path_factory.mktemp("repo")
    run = lambda *args: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,  # noqa: E731
                                       check=True, capture_output=True)
    (repo / "lib.py").write_text("x = 1\n")
    (repo / "gone.py").write_text("y = 2\n")
    run("init", "-q")
    run("add", "-A")
    run("commit", "-qm", "base")
    (repo / "lib.py").write_text("x = 2\n")
    (repo / "gone.py").unlink()
    (repo / "new file.txt").write_text("hello\n")
    (repo / "blob.bin").write_bytes(bytes(range(256)) * 4)
    (repo / "caf\u00e9 \"q\".py").write_text("z = 3\n")
    run("add", "-A")
    return subprocess.run(["git", "diff", "--cached", "--binary", "--no-renames", "HEAD"], cwd=repo, check=True,
                          capture_output=True, text=True).stdout


def test_a_patch_splits_per_file_with_names_kinds_and_binary_parts(real_patch: str) -> None:
    changes = {c.path: c for c in split_patch(real_patch)}
    assert set(changes) == {"lib.py", "gone.py", "new file.txt", "blob.bin", "caf\u00e9 \"q\".py"}
    assert changes["lib.py"].kind == "modified" and changes["gone.py"].kind == "deleted"
    assert changes["new file.txt"].kind == "added" and changes["blob.bin"].binary
    assert "".join(c.text for c in split_patch(real_patch)) == real_patch
    message = describe(real_patch)
    assert message.startswith("Submitted a patch touching 5 file(s) (1 modified, 3 added, 1 deleted; 1 binary)")
    assert "Submitted an empty patch" in describe("")


def test_what_is_left_out_of_the_graded_copy() -> None:
    files, folders = task_test_paths(["tests/test_a.py::test_x", "tests/unit/test_b.py::T::test_y[1-2]", "test_root.py::t"],
                                "diff --git a/tests/data/x.json b/tests/data/x.json\n")
    assert files == {"tests/test_a.py", "tests/unit/test_b.py", "test_root.py", "tests/data/x.json"}
    assert folders == {"tests", "tests/unit", "tests/data"}
    why = lambda path: left_out_because(path, files, folders)  # noqa: E731
    for path in ("conftest.py", "src/pkg/conftest.py", "pyproject.toml", "sub/setup.cfg", "tox.ini", "pytest.ini",
                 "sitecustomize.py", "lib/usercustomize.py", "x.pth", "evil-1.0.dist-info/entry_points.txt",
                 "pkg.egg-info/entry_points.txt", ".gitattributes", "tests/__init__.py", "tests/helpers.py",
                 "test_root.py", "src/test_new.py", "src/new_test.py"):
        assert why(path), path
    for path in ("pkg/__init__.py", "pkg/testing_utils.py", "README.md", "setup.py", "docs/conf.py"):
        assert why(path) is None, path
    patch = ("diff --git a/pkg/a.py b/pkg/a.py\n--- a/pkg/a.py\n+++ b/pkg/a.py\n@@ -1 +1 @@\n-a\n+b\n"
             "diff --git a/conftest.py b/conftest.py\nnew file mode 100644\n--- /dev/null\n+++ b/conftest.py\n@@ -0,0 +1 @@\n+x\n")
    kept, left = graded_part(patch, files, folders)
    assert kept.startswith("diff --git a/pkg/a.py") and "conftest" not in kept
    assert left == [{"path": "conftest.py", "why": "test configuration"}]


def test_the_test_command_must_be_pytest() -> None:
    env, args = grader.parse_test_cmd("PYTHONPATH=src PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -rA -o addopts= -q")
    assert env == {"PYTHONPATH": "src", "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"} and args == ["-rA", "-o", "addopts=", "-q"]
    assert grader.parse_test_cmd("pytest -x") == ({}, ["-x"])
    for bad in ("make test", "python -m unittest", "bash -c 'pytest'", "'unclosed"):
        with pytest.raises(grader.TestCommandError):
            grader.parse_test_cmd(bad)


def test_the_report_counts_only_with_this_runs_key() -> None:
    key = grader.new_key()
    forged = 'ROLLGYM-REPORT 0123 {"tests": {"t": "PASSED"}}'
    real = f'ROLLGYM-REPORT {key} {{"tests": {{"t": "FAILED"}}, "tampered": []}}'
    assert grader.read_report(f"{forged}\n{real}\n", key)["tests"] == {"t": "FAILED"}
    assert grader.read_report(forged, key) is None
    assert grader.read_report(f"ROLLGYM-REPORT {key} not json", key) is None


def test_the_diff_is_read_exactly_or_refused() -> None:
    patch = "diff --git a/\xff b/\xff\n".encode("latin-1")
    assert grader.read_diff(f"size {len(patch)}\n{base64.b64encode(patch).decode()}") == (patch, None)
    assert grader.read_diff("too_large 99999999")[1] == "patch_too_large: 99999999 bytes"
    assert grader.read_diff(f"size {len(patch) + 5}\n{base64.b64encode(patch).decode()}")[1].startswith("patch_unreadable")
    assert grader.read_diff("fatal: something")[1] == "patch_unreadable"


def test_the_runner_is_a_file_of_its_own() -> None:
    assert Path(grader.RUNNER).is_file() and "ROLLGYM-REPORT" in grader.runner_source()


def test_a_copy_of_the_fix_where_the_sandbox_can_read_it_is_found(tmp_path: Path) -> None:
    patch = ("diff --git a/parse/__init__.py b/parse/__init__.py\n--- a/parse/__init__.py\n+++ b/parse/__init__.py\n"
             "@@ -1,2 +1,4 @@\n     m = search()\n+    if m is None:\n+        return None\n     return m\n")
    fixed = tmp_path / "toolchain" / "lib" / "_vendor" / "parse" / "__init__.py"
    buggy = tmp_path / "system" / "parse" / "__init__.py"
    for path, text in ((fixed, "def f():\n    m = search()\n    if m is None:\n        return None\n    return m\n"),
                       (buggy, "def f():\n    m = search()\n    return m\n")):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    roots = (str(tmp_path / "system"), str(tmp_path / "toolchain"))
    assert solution_copies(patch, roots) == [str(fixed)]
    assert solution_copies(patch, (str(tmp_path / "system"),)) == []


def test_a_copy_of_a_root_module_is_found_anywhere_and_only_it_is_hidden(tmp_path: Path) -> None:
    """A module at the repository's root (`xmltodict.py`) is installed as a file among others (site-packages)
    or vendored as a package: both are copies; the first is hidden alone, the package's folder whole."""
    patch = ("diff --git a/single.py b/single.py\n--- a/single.py\n+++ b/single.py\n"
             "@@ -1,2 +1,3 @@\n def f(x):\n+    x = abs(x)\n     return x\n")
    fixed = "def f(x):\n    x = abs(x)\n    return x\n"
    installed = tmp_path / "site-packages" / "single.py"
    vendored = tmp_path / "_vendor" / "single" / "__init__.py"
    for path in (installed, vendored):
        path.parent.mkdir(parents=True)
        path.write_text(fixed)
    (tmp_path / "site-packages" / "other.py").write_text(fixed)  # another name: not a copy
    roots = (str(tmp_path),)
    assert sorted(solution_copies(patch, roots)) == sorted([str(installed), str(vendored)])
    assert hidden_paths(patch, roots) == tuple(sorted([str(installed), str(vendored.parent)]))


def test_the_roots_searched_are_what_the_sandbox_shows() -> None:
    """The system folders, the toolchain, and its interpreter's prefix (a venv's base Python is shown whole)."""
    roots = sandbox_roots(sys.prefix)
    assert "/usr" in roots and os.path.abspath(sys.prefix) in roots
    assert os.path.realpath(sys.base_prefix) in roots
