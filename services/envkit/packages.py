"""Environments a stack can use: folders of the checkout, and Python packages installed anywhere.

A package makes an environment available by an entry point in the `rollgym.environments` group,
pointing at an import package laid out like a folder (app.py, configs/, data/, tests/):

    [project.entry-points."rollgym.environments"]
    acme_quiz = "acme_quiz"

A stack config then names it as it names a folder, `resources_servers: {acme_quiz: {...}}`: when no
resources_servers/acme_quiz/ is found next to the config or in the current directory, the installed
package of that name serves (rollgym.config). `rollgym env list` shows both kinds, read without
importing them (the module docstring, its @tool methods, the first example row).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
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

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "path": str(self.path), "summary": self.summary,
                "tools": self.tools, "example": self.example, "problem": self.problem}


def environment_cards(root: Path) -> list[EnvironmentCard]:
    """The environment folders under root/resources_servers, then the installed packages."""
    cards = [describe(path.parent.name, "folder", path.parent)
             for path in sorted((root / "resources_servers").glob("*/app.py"))]
    for env in sorted(installed_environments().values(), key=lambda e: e.name):
        cards.append(describe(env.name, f"package {env.distribution}", env.path))
    return cards


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
           "environment_problems", "installed_environments"]
