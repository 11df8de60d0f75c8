"""The house rules of services/ (imported as `rollgym`), checked by reading its imports.

- no import circle, and no module imports another's private (`_name`) names;
- the kernel (the flat modules) imports no wing; nothing imports the command line;
- a wing imports only the wings of its row in WING_IMPORTS (data flows one way: no arrow back up);
- inside train/, a door imports only the doors of its row in TRAIN_DOORS (loop drives orchestrator and
  trainers, which import neither it nor each other), every module sits behind a door, and no module
  grows past LONGEST lines;
- no import circle inside a server folder (agents/, models/, resources_servers/);
- argparse only in rollgym.cli (and the two internal process entry points);
- `rollgym.cli` and the collector start without the web stack (fastapi, uvicorn, openai);
- the lazy facade's `_EXPORTS`, `__all__` and TYPE_CHECKING imports agree and every name resolves;
- pyproject's package list names every package folder of services/.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = REPO / "services" / "rollgym"
WINGS = {"stack", "rollouts", "data", "envkit", "view", "train", "eval", "traces", "sandbox", "cli"}
# The wings each wing may import (besides the kernel). Data flows one way: rollouts -> data -> train,
# so data/ imports neither the collection (rollouts/) nor the operators (stack/).
WING_IMPORTS = {
    "data": set(),
    "sandbox": set(),  # workspaces and the launcher: environments import it, it imports no other wing
    "rollouts": {"data"},  # the one JSONL reader, which agent a row goes to
    "stack": {"rollouts"},  # the Ray collector shards
    "envkit": {"data", "stack"},  # checks read example rows and start servers
    "view": {"data", "rollouts"},
    "eval": {"data", "rollouts"},  # only train imports eval (a plan validates on an eval suite)
    "traces": {"data"},  # spans and datasets in, records out; train reads its trace:// sources, never the reverse
    "train": {"data", "eval", "rollouts", "stack", "traces"},
    "cli": WINGS - {"cli"},  # each command's handler imports its wing
}
# The three doors of services/train/: the loop drives the other two, which import neither it nor each other.
TRAIN_DOORS = {"loop": {"orchestrator", "trainers"}, "orchestrator": set(), "trainers": set()}
# No module of services/train/ grows past LONGEST lines.
LONGEST = 560
# Server folders: each is one package whose modules may import each other, without a circle.
SERVER_FOLDERS = sorted(folder for role in ("agents", "models", "resources_servers")
                        for folder in (REPO / role).iterdir() if folder.is_dir() and any(folder.rglob("*.py")))
# Processes of their own, started with `python -m`: the launcher's child and the test backend.
ARGPARSE_ENTRY_POINTS = {"rollgym.stack.serve", "rollgym.testing.scripted_vllm"}


def module_name(path: Path) -> str:
    parts = ["rollgym", *path.relative_to(SERVICES).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in SERVICES.rglob("*.py")}


def resolve(name: str) -> str | None:
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> list[tuple[str, str | None, str]]:
    """(imported rollgym module, imported name or None, raw module name) for every import, nested ones too."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            for alias in node.names:
                sub = f"{full}.{alias.name}"
                found.append((sub if sub in MODULES else full, alias.name, full))
    return found


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for module in MODULES:
        for target, _, _ in imports_of(module):
            dest = resolve(target) if target.startswith("rollgym") else None
            if dest and dest not in (module, "rollgym"):
                graph[module].add(dest)
    return graph


def wing_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in WINGS else None


def circles_in(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle() -> None:
    assert not circles_in(edges())


def test_no_private_import_across_modules() -> None:
    private = [f"{module} imports {target}.{name}" for module in MODULES for target, name, _ in imports_of(module)
               if target.startswith("rollgym") and name and name.startswith("_") and not name.startswith("__")
               and resolve(target) not in (module, None)]
    assert not private


def test_the_kernel_imports_no_wing_and_nothing_imports_the_cli() -> None:
    wrong = []
    for module, targets in edges().items():
        for target in targets:
            if wing_of(target) == "cli" and wing_of(module) != "cli":
                wrong.append(f"{module} imports the command line ({target})")
            if wing_of(module) is None and wing_of(target) is not None and module != "rollgym":
                wrong.append(f"kernel module {module} imports wing module {target}")
    assert not wrong


def test_wings_import_only_the_wings_of_their_row() -> None:
    assert set(WING_IMPORTS) == WINGS, "every wing has a row in WING_IMPORTS"
    wrong = sorted(f"{module} imports {target} ({wing_of(module)} -> {wing_of(target)} is not in WING_IMPORTS)"
                   for module, targets in edges().items() for target in targets
                   if wing_of(module) and wing_of(target) not in (None, wing_of(module))
                   and wing_of(target) not in WING_IMPORTS[wing_of(module)])
    assert not wrong


def door_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "train" and parts[2] in TRAIN_DOORS else None


def test_the_train_doors_import_only_what_their_row_allows() -> None:
    wrong = sorted(f"{module} imports {target} ({door_of(module)} -> {door_of(target)} is not in TRAIN_DOORS)"
                   for module, targets in edges().items() for target in targets
                   if door_of(module) and door_of(target) not in (None, door_of(module))
                   and door_of(target) not in TRAIN_DOORS[door_of(module)])
    assert not wrong
    loose = sorted(module for module in MODULES if wing_of(module) == "train" and module != "rollgym.train"
                   and door_of(module) is None)
    assert not loose, "every module of services/train/ sits behind one of its doors"


def test_train_modules_stay_readable() -> None:
    long = {module: n for module in MODULES if wing_of(module) == "train"
            and (n := len(MODULES[module].read_text().splitlines())) > LONGEST}
    assert not long, f"split these along what they do: {long}"


def folder_edges(folder: Path) -> dict[str, set[str]]:
    """The imports between one server folder's modules, named relative to the folder (`app`,
    `tests.test_app`): relative imports and absolute ones through its package (`agents.proxy_agent.app`)."""
    package = ".".join(folder.relative_to(REPO).parts)
    modules: dict[str, Path] = {}
    for path in folder.rglob("*.py"):
        parts = path.relative_to(folder).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path

    def local(name: str) -> str | None:
        """The folder's module that `name` (relative to the folder, "" for the folder) is or lies in."""
        while name:
            if name in modules:
                return name
            name = name.rpartition(".")[0]
        return "__init__" if "__init__" in modules else None

    graph: dict[str, set[str]] = {module: set() for module in modules}
    for module, path in modules.items():
        here = [] if module == "__init__" else module.split(".")[: None if path.name == "__init__.py" else -1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)] if node.level - 1 <= len(here) else None
                    if base is None:
                        continue  # above the folder
                    full = ".".join([package, *base, *([node.module] if node.module else [])])
                else:
                    full = node.module or ""
                # `from . import chat` imports the module chat; `from .app import Rollout`, a name of app
                names = [f"{full}.{alias.name}" if f"{full}.{alias.name}"[len(package) + 1:] in modules else full
                         for alias in node.names]
            else:
                continue
            for name in names:
                if name != package and not name.startswith(package + "."):
                    continue
                target = local(name[len(package) + 1:])
                if target and target != module:
                    graph[module].add(target)
    return graph


@pytest.mark.parametrize("folder", SERVER_FOLDERS, ids=lambda folder: "/".join(folder.parts[-2:]))
def test_no_import_circle_inside_a_server_folder(folder: Path) -> None:
    assert not circles_in(folder_edges(folder))


def test_argparse_lives_in_the_cli() -> None:
    users = {module for module in MODULES for _, _, raw in imports_of(module) if raw == "argparse"}
    assert users - ARGPARSE_ENTRY_POINTS == {m for m in users if wing_of(m) == "cli"}


def test_the_checks_see_imports_and_circles() -> None:
    assert circles_in({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert "rollgym.rollouts.attempts" in edges()["rollgym.rollouts.collector"]  # relative imports are read
    assert "rollgym.client" in edges()["rollgym.rollouts.attempts"]
    assert door_of("rollgym.train.loop.epochs") == "loop" and door_of("rollgym.train") is None
    assert "rollgym.train.trainers.jobs" in edges()["rollgym.train.loop.optimize"]  # a door's arrow is seen
    chat_completions = folder_edges(REPO / "models" / "chat_completions")
    assert {"adapters", "routing"} <= chat_completions["app"]  # relative imports are read
    assert "app" in chat_completions["tests.test_app"]  # and absolute ones through the folder's package


@pytest.mark.parametrize("module", ["rollgym.cli", "rollgym.rollouts.collector"])
def test_cli_and_collector_start_without_the_web_stack(module: str) -> None:
    code = (f"import sys, {module}\n"
            "import rollgym.cli; rollgym.cli.build_parser()\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'openai', 'starlette') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_the_facade_agrees_with_itself() -> None:
    import rollgym

    tree = ast.parse((SERVICES / "__init__.py").read_text())
    checked: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom)
                for alias in stmt.names:
                    checked[alias.name] = "." * stmt.level + (stmt.module or "")
    exports = rollgym._EXPORTS
    assert set(exports) == set(rollgym.__all__) == set(checked)
    assert exports == checked, "TYPE_CHECKING imports and _EXPORTS name other modules"
    for name, module in exports.items():
        value = getattr(importlib.import_module(module, "rollgym"), name)
        assert getattr(rollgym, name) is value


def test_pyproject_lists_every_package() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert config["package-dir"] == {"": "services"}
    folders = {module_name(path.parent / "__init__.py") for path in SERVICES.rglob("__init__.py")}
    data_folders = set(config.get("package-data", {}))  # e.g. the viewer's static/, listed for its files
    assert set(config["packages"]) - data_folders == folders
