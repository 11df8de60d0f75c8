"""`rollgym train PLAN --rewind N`: continue a run from the end of an earlier epoch (or async step).

Each finished epoch saves the run's state (applied, last and best artefacts) in its folder as
`state.json`. Rewinding to epoch N restores that state, keeps history.jsonl up to N, and moves what
came after (later epoch folders, their history lines, an async run's later orchestrator steps) into
`OUTPUT/rewound/<when>/`: nothing is deleted, and the same command then trains on from epoch N's
weights, trainer state included. An epoch whose weights were pruned (`checkpoints.keep_last`) cannot
be rewound to; `checkpoints.every` keeps every Nth one for that. If the best model as of epoch N was
pruned since, the guard starts over from N (it compares with later epochs only).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import orjson

STATE_FILE = "state.json"


class RewindError(RuntimeError):
    """The run cannot be rewound to that point; the message says why and which points it can."""


def _read_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    if path.is_file():
        for raw in path.read_bytes().splitlines():
            try:
                lines.append(orjson.loads(raw))
            except orjson.JSONDecodeError:
                continue  # a line torn by a kill
    return lines


def _weights(*artefacts: dict[str, Any] | None) -> list[str]:
    """The files of artefacts' weights (local ones)."""
    paths = []
    for artefact in artefacts:
        for key in ("uri", "serving_uri"):
            uri = (artefact or {}).get(key)
            if uri and "://" not in uri:  # a remote job's uri is not ours to check
                paths.append(uri)
    return paths


def _missing(folder: Path) -> str | None:
    """Why the state saved in a finished epoch's folder cannot be restored (None: it can)."""
    saved = folder / STATE_FILE
    if not saved.is_file():
        return f"{saved} is missing (the run predates rewinding)"
    state = orjson.loads(saved.read_bytes())
    gone = [path for path in _weights(state.get("applied"), state.get("last")) if not Path(path).exists()]
    return f"its weights {gone[0]} were pruned (checkpoints.keep_last)" if gone else None


def rewind(output: Path, to: int, unit: str, log: Callable[[str], None] = print) -> Path:
    """Rewind the run in `output` to the end of `unit` ("epoch" or "step") number `to`; the folder
    that now holds what came after it."""
    history = _read_lines(output / "history.jsonl")
    finished = sorted({int(line["epoch"]) for line in history if "epoch" in line})
    if to not in finished:
        shown = f"{finished[0]}..{finished[-1]}" if finished else "none"
        raise RewindError(f"{output}: {unit} {to} is not a finished {unit} of this run (finished: {shown})")
    folder = output / f"{unit}-{to:03d}"
    problem = _missing(folder)
    if problem is not None:
        possible = [n for n in finished if _missing(output / f"{unit}-{n:03d}") is None]
        raise RewindError(f"cannot rewind to {unit} {to}: {problem}; {unit}s it can rewind to: "
                          f"{', '.join(map(str, possible)) or 'none'}")
    aside = output / "rewound" / f"after-{unit}-{to:03d}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir(parents=True)
    moved = 0
    pattern = re.compile(rf"^{unit}-(\d+)$")
    for path in sorted(output.iterdir()):
        match = pattern.match(path.name)
        if match and int(match.group(1)) > to:
            shutil.move(str(path), aside / path.name)
            moved += 1
    steps = output / "orchestrator" / "steps"  # an async run's published batches after the step
    if steps.is_dir():
        for path in sorted(steps.iterdir()):
            match = re.match(r"^\.?step_(\d+)(\.tmp)?$", path.name)
            if match and int(match.group(1)) > to:
                (aside / "orchestrator-steps").mkdir(exist_ok=True)
                shutil.move(str(path), aside / "orchestrator-steps" / path.name)
    kept = [line for line in history if int(line.get("epoch", 0)) <= to]
    later = [line for line in history if int(line.get("epoch", 0)) > to]
    (aside / "history.jsonl").write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in later))
    _replace(output / "history.jsonl", b"".join(orjson.dumps(line) + b"\n" for line in kept))
    state = orjson.loads((folder / STATE_FILE).read_bytes())
    state["stopped"] = None
    best = (state.get("best") or {}).get("artefact")
    if any(not Path(path).exists() for path in _weights(best)):
        # Pruned since (checkpoints.every keeps the step, not an older best): the guard starts over here.
        log(f"the best model as of {unit} {to} was pruned since: the guard compares with later {unit}s only")
        state["best"] = None
    _replace(output / STATE_FILE, orjson.dumps(state, option=orjson.OPT_INDENT_2))
    log(f"rewound to {unit} {to}: {moved} later {unit} folder(s) and {len(later)} history line(s) moved to {aside}")
    return aside


def _replace(path: Path, data: bytes) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_bytes(data)
    partial.replace(path)


__all__ = ["STATE_FILE", "RewindError", "rewind"]
