"""The train wing's YAML files (a plan, an orchestrator config): read as a mapping, and their validation
errors phrased as `FILE: key 'stages[1].collect.repeats': ...`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from pydantic import ValidationError

from ..errors import format_location


def read_mapping(path: Path, kind: str, keys: str) -> dict[str, Any]:
    """The mapping a YAML (or JSON) file holds; ValueError naming the file when it is missing, a folder,
    unreadable, not YAML, empty or not a mapping. `kind` names the file ("plan"), `keys` a few of its keys."""
    import yaml

    article = "an" if kind[0] in "aeiou" else "a"
    if path.is_dir():
        raise ValueError(f"{path}: is a folder, not {article} {kind} file")
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {kind} file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it: {exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    shape = f"{article} {kind} is a mapping of keys ({keys}, ...)"
    if data is None:
        raise ValueError(f"{path}: is empty; {shape}")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: {shape}, not a {type(data).__name__}")
    return data


def key_problems(path: Path, exc: ValidationError, note: Callable[[str], str] = lambda key: "") -> str:
    """One line per validation error: the file, the key at fault, the message, and `note(key)`."""
    lines = []
    for error in exc.errors():
        key = format_location(error["loc"]) if error["loc"] else "(top level)"
        lines.append(f"{path}: key '{key}': {error['msg'].removeprefix('Value error, ')}{note(key)}")
    return "\n".join(lines)


__all__ = ["key_problems", "read_mapping"]
