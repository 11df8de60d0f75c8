"""Environments a stack can use: folders of the checkout, and Python packages installed anywhere.

A package makes an environment available by an entry point in the `rollgym.environments` group,
pointing at an import package laid out like a folder (app.py, configs/, data/, tests/):

    [project.entry-points."rollgym.environments"]
    acme_quiz = "acme_quiz"

A stack config then names it as it names a folder, `resources_servers: {acme_quiz: {...}}`: when no
resources_servers/acme_quiz/ is found next to the config or in the current directory, the installed
package of that name serves (rollgym.config). `rollgym env list` shows both kinds, read without
importing them (the module docstring, its @tool methods, the first example row).

It also lists the verifiers (`verifiers.v1`) Envs installed as packages, which run as the proxy
agent's `verifiers` runner, each with the config line that runs it. verifiers has no registry of
them: an Env is named by its taskset id, a top-level module that exports a `Taskset` subclass via
`__all__` (verifiers.v1.utils.loaders). So these are the top-level modules of the distributions that
require verifiers whose `__all__` exports a class based on `Taskset`, read from their source
without importing them (nor verifiers).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from importlib.metadata import Distribution, distributions
from pathlib import Path
from typing import Any

import orjson

from ..config import ENVIRONMENTS_GROUP as GROUP
from ..config import InstalledEnvironment, environment_problems, installed_environments


@dataclass
class EnvironmentCard:
    """What `rollgym env list` says about one environment."""

    name: str
    source: str  # "folder" or "package DIST"
    path: Path
    summary: str = ""
    tools: list[str] = field(default_factory=list)
    example: str = ""
    problem: str = ""
    config: str = ""  # for a verifiers Env: the proxy agent's `agent:` line that runs it

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "path": str(self.path), "summary": self.summary,
                "tools": self.tools, "example": self.example, "problem": self.problem, "config": self.config}


def environment_cards(root: Path) -> list[EnvironmentCard]:
    """The environment folders under root/resources_servers, the installed packages, then the
    installed verifiers Envs."""
    cards = [describe(path.parent.name, "folder", path.parent)
             for path in sorted((root / "resources_servers").glob("*/app.py"))]
    for env in sorted(installed_environments().values(), key=lambda e: e.name):
        cards.append(describe(env.name, f"package {env.distribution}", env.path))
    cards.extend(verifiers_environments())
    return cards


# --- verifiers Envs --------------------------------------------------------------------------------

_REQUIREMENT_NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_TASKSET = re.compile(r"\bTaskset\b")  # vf.Taskset[...], not vf.TasksetConfig
_HARNESS = re.compile(r"\bHarness\b")


def verifiers_environments() -> list[EnvironmentCard]:
    """A card per installed verifiers Env (a top-level module of a distribution that requires
    verifiers, exporting a Taskset subclass), with `config` the proxy agent's line that runs it."""
    cards: dict[str, EnvironmentCard] = {}
    for dist in distributions():
        if not _requires_verifiers(dist):
            continue
        for module, source in _top_level_sources(dist):
            if module in cards:
                continue
            exports = _exported_bases(source)
            if not any(_TASKSET.search(base) for base in exports.values()):
                continue
            # A module that also exports a Harness is its own default harness (verifiers'
            # default_harness_id); else verifiers' chat program (`null`), which needs no shell.
            harness = module if any(_HARNESS.search(base) for base in exports.values()) else "null"
            card = EnvironmentCard(module, f"verifiers package {dist.metadata['Name']}", source)
            tree = _parsed(source)
            if tree is not None:
                card.summary = (ast.get_docstring(tree) or "").strip().split("\n\n")[0].replace("\n", " ")
                card.tools = sorted({name for path in _module_files(source) for name in _tool_names(path)})
            card.config = (f"agent: {{kind: verifiers, env: {{taskset: {{id: {module}}}, agent: {{harness: "
                           f'{{id: "{harness}"}}, runtime: {{type: subprocess}}}}}}}}')
            cards[module] = card
    return sorted(cards.values(), key=lambda card: card.name)


def _requires_verifiers(dist: Distribution) -> bool:
    """An unconditional requirement on verifiers (an extra's does not make the package an Env)."""
    for requirement in dist.requires or []:
        name, _, marker = requirement.partition(";")
        match = _REQUIREMENT_NAME.match(name)
        if match and match.group(1).lower().replace("_", "-") == "verifiers" and "extra" not in marker:
            return True
    return False


def _top_level_sources(dist: Distribution) -> list[tuple[str, Path]]:
    """(import name, its `NAME.py` or `NAME/__init__.py`) for each top-level module the distribution installed."""
    found = {}
    for file in dist.files or []:
        parts = file.parts
        if len(parts) == 1 and parts[0].endswith(".py"):
            found.setdefault(parts[0][:-3], Path(str(dist.locate_file(file))))
        elif len(parts) == 2 and parts[1] == "__init__.py" and parts[0].isidentifier():
            found.setdefault(parts[0], Path(str(dist.locate_file(file))))
    return [(name, path) for name, path in sorted(found.items()) if name.isidentifier() and path.is_file()]


def _parsed(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None


def _module_files(source: Path) -> list[Path]:
    return sorted(source.parent.rglob("*.py")) if source.name == "__init__.py" else [source]


def _exported_bases(source: Path) -> dict[str, str]:
    """{name in `__all__`: its base classes as source text}, following `from .sub import Name`."""
    tree = _parsed(source)
    if tree is None:
        return {}
    exported: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if "__all__" in [getattr(target, "id", "") for target in targets] and node.value is not None:
            try:
                exported = [str(name) for name in ast.literal_eval(node.value)]
            except (ValueError, TypeError, SyntaxError):
                return {}
    classes = _class_bases(tree)
    if source.name == "__init__.py":
        for node in tree.body:
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level <= 1):
                continue
            parts = node.module.split(".")
            if node.level == 0 and (parts[0] != source.parent.name or len(parts) == 1):
                continue  # another package's names
            sub = source.parent.joinpath(*parts[1 if node.level == 0 else 0:])
            for candidate in (sub.with_suffix(".py"), sub / "__init__.py"):
                if candidate.is_file() and (subtree := _parsed(candidate)) is not None:
                    classes = {**_class_bases(subtree), **classes}
    return {name: classes[name] for name in exported if name in classes}


def _class_bases(tree: ast.Module) -> dict[str, str]:
    return {node.name: " ".join(ast.unparse(base) for base in node.bases)
            for node in tree.body if isinstance(node, ast.ClassDef)}


def _tool_names(path: Path) -> list[str]:
    tree = _parsed(path)
    return [] if tree is None else [
        node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and any(_decorator_name(d) == "tool" for d in node.decorator_list)]


def describe(name: str, source: str, folder: Path) -> EnvironmentCard:
    """Read a folder's card from its files, never importing its code (a broken module still lists)."""
    card = EnvironmentCard(name, source, folder)
    try:
        tree = ast.parse((folder / "app.py").read_text())
    except (OSError, SyntaxError, ValueError) as exc:
        card.problem = f"app.py: {type(exc).__name__}: {exc}"
        return card
    card.summary = (ast.get_docstring(tree) or "").strip().split("\n\n")[0].replace("\n", " ")
    card.tools = [node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                  and any(_decorator_name(d) == "tool" for d in node.decorator_list)]
    card.example = _first_prompt(folder / "data" / "example.jsonl")
    return card


def _decorator_name(node: ast.expr) -> str:
    target = node.func if isinstance(node, ast.Call) else node
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")


def _first_prompt(path: Path) -> str:
    """The last user message of the first example row (its string input, if it has one)."""
    try:
        with path.open("rb") as handle:
            row = orjson.loads(handle.readline())
    except (OSError, orjson.JSONDecodeError):
        return ""
    given = (row.get("responses_create_params") or {}).get("input") if isinstance(row, dict) else None
    if isinstance(given, str):
        return given
    users = [item.get("content") for item in given or [] if isinstance(item, dict) and item.get("role") == "user"]
    text = users[-1] if users else ""
    if isinstance(text, list):  # content parts
        text = " ".join(part.get("text", "") for part in text if isinstance(part, dict))
    return str(text)


__all__ = ["GROUP", "EnvironmentCard", "InstalledEnvironment", "describe", "environment_cards",
           "environment_problems", "installed_environments", "verifiers_environments"]
