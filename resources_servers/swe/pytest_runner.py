"""The grader's test runner: run inside the graded sandbox as `python -I runner.py ARGS`, never imported by
the server. Standard library and pytest only.

It reads a one-time key on stdin (so it is in no file and no environment the tests could read), imports
pytest from the toolchain *before* the repository is put on `sys.path` (a `pytest.py`, `sitecustomize.py`
or `.pth` of the patch shadows nothing), runs pytest in-process with its own plugin, which records each
test's outcome from the reports as they are made, and writes one line to fd 3:

    ROLLGYM-REPORT <key> {"tests": {node id: PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS}, "collect_errors": [...],
                          "tampered": [...], "exit_status": N}

A line without the key (a test printing one, a file the patch wrote) is not the report. `tampered` names
pytest's, pluggy's, unittest's and the runtime's functions and classes (`builtins`, `sys`, `os`, `time`),
and import hooks and trace functions, that something other than the toolchain replaced (a function
defined in the repository or built from a string, an instance, a C function) and did not put back:
the grade is then 0, whatever the reports say. pytest's own patches (and its plugins') are the
toolchain's, hence allowed.
"""

import os
import sys

KEY = sys.stdin.buffer.readline().strip().decode("ascii", "replace")
REPORT = os.fdopen(os.dup(3), "w") if KEY else None
os.close(3)  # the report's fd is a private dup of it now
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)

import builtins  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

import pluggy  # noqa: E402
import pytest  # noqa: E402

# What pytest decides outcomes with (checked at every report) and what tests may patch for a while with
# monkeypatch (checked once the test's fixtures are torn down, and at the end).
RUNNER_MODULES = ("_pytest.runner", "_pytest.reports", "_pytest.python", "_pytest.main", "_pytest.outcomes",
                  "_pytest.skipping", "_pytest.terminal", "_pytest.unittest", "_pytest.fixtures", "_pytest.nodes",
                  "_pytest.assertion.rewrite", "_pytest.assertion.util", "_pytest.config", "_pytest.warnings",
                  "_pytest.capture", "pluggy._hooks", "pluggy._callers", "pluggy._manager", "pluggy._result",
                  "unittest.case", "unittest.result", "pytest")
RUNTIME_MODULES = ("builtins", "sys", "os", "time")
STATE_NAMES = {("sys", "stdout"), ("sys", "stderr"), ("sys", "stdin"), ("sys", "__stdout__"), ("sys", "__stderr__"),
               ("sys", "__stdin__"), ("sys", "displayhook"), ("sys", "excepthook"), ("sys", "unraisablehook"),
               ("sys", "breakpointhook"), ("builtins", "_"), ("os", "environ")}


def _callables(module_name: str) -> dict[str, int]:
    """{qualified name: id} of a module's functions and classes, and of those classes' own attributes."""
    module = sys.modules.get(module_name) or importlib.import_module(module_name)
    seen: dict[str, int] = {}
    for name, value in list(vars(module).items()):
        if (module_name, name) in STATE_NAMES or not callable(value):
            continue
        seen[f"{module_name}.{name}"] = id(value)
        if isinstance(value, type) and getattr(value, "__module__", None) == module_name:
            for attr, member in list(vars(value).items()):
                if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                    seen[f"{module_name}.{name}.{attr}"] = id(member)
    return seen


def fingerprint(modules: tuple[str, ...]) -> dict[str, int]:
    prints: dict[str, int] = {}
    for module_name in modules:
        prints.update(_callables(module_name))
    return prints


TRUSTED = tuple(sorted({os.path.realpath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix,
                                                                 os.path.dirname(os.__file__))}))


def origin(value: object) -> str | None:
    """The file that defines a function or class (None for anything else: an instance, a C function)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        value = value.fget
    if isinstance(value, types.MethodType):
        value = value.__func__
    code = getattr(value, "__code__", None)
    if isinstance(value, types.FunctionType) and code is not None:
        return code.co_filename
    if isinstance(value, type):
        return getattr(sys.modules.get(value.__module__), "__file__", None)
    return None


def trusted(value: object) -> bool:
    """Defined in the toolchain (a pytest plugin's patch), not in the repository or from a string."""
    where = origin(value)
    if not where:
        return False
    real = os.path.realpath(where)
    return real.startswith(TRUSTED) and not real.startswith(os.path.realpath(os.getcwd()) + os.sep)


def _lookup(name: str, modules: tuple[str, ...]) -> object:
    for module_name in sorted(modules, key=len, reverse=True):
        if name.startswith(module_name + "."):
            value: object = sys.modules.get(module_name)
            for part in name[len(module_name) + 1:].split("."):
                value = vars(value).get(part) if hasattr(value, "__dict__") else None
            return value
    return None


def changed(before: dict[str, int], modules: tuple[str, ...]) -> list[str]:
    """The names whose objects were replaced (or removed) by something that is not the toolchain's."""
    now = fingerprint(modules)
    return sorted(name for name, ident in before.items()
                  if now.get(name) != ident and not trusted(_lookup(name, modules)))


def hooks_state() -> list[object]:
    return [*sys.meta_path, *sys.path_hooks]


def hooks_tampered(before: list[object]) -> list[str]:
    """Import hooks and trace functions the repository's code added (pytest's own come from the toolchain)."""
    added = [hook for hook in hooks_state() if not any(hook is old for old in before)]
    found = [f"sys.meta_path/path_hooks: {type(hook).__name__}" for hook in added
             if not trusted(hook if isinstance(hook, (type, types.FunctionType)) else type(hook))]
    for name, function in (("sys.settrace", sys.gettrace()), ("sys.setprofile", sys.getprofile())):
        if function is not None and not trusted(function):
            found.append(name)
    return found


class Recorder:
    """The runner's own plugin: each test's outcome, from the reports, as they are made."""

    def __init__(self) -> None:
        self.tests: dict[str, str] = {}
        self.collect_errors: list[dict[str, str]] = []
        self.tampered: set[str] = set()
        self.runner_print = fingerprint(RUNNER_MODULES)
        self.runtime_print = fingerprint(RUNTIME_MODULES)
        self.hooks = hooks_state()

    @pytest.hookimpl(tryfirst=True)
    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.collect_errors.append({"node": report.nodeid, "error": str(report.longrepr)[-3000:]})

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tampered.update(changed(self.runner_print, RUNNER_MODULES))
        if report.when == "teardown":
            self.tampered.update(changed(self.runtime_print, RUNTIME_MODULES))
        node = report.nodeid
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if hasattr(report, "wasxfail"):
                outcome = "XFAIL" if report.skipped else "XPASS"
            elif report.passed:
                outcome = "PASSED"
            elif report.skipped:
                outcome = "SKIPPED"
            else:
                outcome = "FAILED" if report.when == "call" else "ERROR"
            self.tests[node] = outcome
        elif report.when == "teardown" and report.failed:
            self.tests[node] = "ERROR"


def main(argv: list[str]) -> int:
    cwd = os.getcwd()
    # The repository goes on sys.path only now, after pytest and the checks' modules are imported.
    extra = [os.path.join(cwd, entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    sys.path[:0] = [cwd, *extra]
    recorder = Recorder()
    started = time.monotonic()
    status: int | str
    try:
        status = int(pytest.main(["-p", "no:cacheprovider", *argv], plugins=[recorder]))
    except BaseException as exc:  # noqa: BLE001 - reported below with the rest
        status = f"{type(exc).__name__}: {exc}"[:500]
    wall = time.monotonic() - started
    recorder.tampered.update(hooks_tampered(recorder.hooks))
    recorder.tampered.update(changed(recorder.runner_print, RUNNER_MODULES))
    recorder.tampered.update(changed(recorder.runtime_print, RUNTIME_MODULES))
    report = {"tests": recorder.tests, "collect_errors": recorder.collect_errors[:20],
              "tampered": sorted(recorder.tampered)[:50], "exit_status": status, "wall_s": round(wall, 3)}
    if REPORT is not None:
        REPORT.write(f"ROLLGYM-REPORT {KEY} {json.dumps(report)}\n")
        REPORT.flush()
    return 0


if __name__ == "__main__":
    _kept = (builtins, pluggy)  # imported for the fingerprints (sys.modules), before the repository is importable
    sys.exit(main(sys.argv[1:]))
