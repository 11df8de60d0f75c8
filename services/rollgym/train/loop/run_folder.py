"""The output folder of a `rollgym train` run: its layout, and every read and write of it.

    OUTPUT/plan.json              the validated plan the run started with
    OUTPUT/state.json             the applied, last and best artefacts, curriculum levels, whether it stopped
    OUTPUT/history.jsonl          one line per finished epoch (async: step); epoch 0: the base model's validation
    OUTPUT/reward.png, steps.png  drawn from history.jsonl (history.py)
    OUTPUT/serving/               the GGUF the embedded model serves (apply: merged)
    OUTPUT/epoch-NNN/             (async: step-NNN/) phases.json (each finished phase's result: not redone),
                                  rollouts.jsonl, curated.jsonl, train/ (artefact.json, adapter/, train.log),
                                  validation*.jsonl, and state.json: the run's state as the epoch finished
    OUTPUT/orchestrator/          async: the orchestrator's history.jsonl, failures.jsonl and steps/
    OUTPUT/rewound/<when>/        what `--rewind N` moved aside

Killing the command and running it again continues where it stopped: the plan must be the same (but for
`RESUMABLE_CHANGES`), a history line torn by the kill is dropped, and the state is read back.

`rollgym train PLAN --rewind N` continues from the end of an earlier epoch (or async step): it restores
the state saved in that epoch's folder, keeps history.jsonl up to N, and moves what came after (later epoch
folders, their history lines, an async run's later orchestrator steps) into `OUTPUT/rewound/<when>/`:
nothing is deleted, and the same command then trains on from epoch N's weights, trainer state included.
An epoch whose weights were pruned (`checkpoints.keep_last`) cannot be rewound to; `checkpoints.every`
keeps every Nth one for that. If the best model as of epoch N was pruned since, the guard starts over from
N (it compares with later epochs only).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import orjson

from ...data.jsonl import read_whole_lines, write_atomic, write_json_atomic, write_jsonl_atomic
from ..trainers.jobs import ARTEFACT_FILE
from .errors import TrainError
from .plan import Plan, renamed_keys

STATE_FILE = "state.json"
HISTORY_FILE = "history.jsonl"
PLAN_FILE = "plan.json"

# What a resumed run may change: how rollouts are retried and filtered, how the run is guarded,
# tracked and pruned; never what the steps already taken trained on or toward.
RESUMABLE_CHANGES = ("stack.concurrency", "stack.timeout_s", "stack.max_attempts", "stack.budget_s",
                     "orchestrator.difficulty", "orchestrator.max_drops_per_step", "orchestrator.concurrency",
                     "orchestrator.timeout_s", "orchestrator.max_attempts", "orchestrator.budget_s",
                     "guard", "tracking", "checkpoints",
                     # How a step is computed, not what it computes: a run killed for memory resumes with less.
                     *(f"{where}optimize.args.{key}" for where in ("", "stages[].")
                       for key in ("micro_batch_tokens", "gradient_checkpointing", "threads")))


class RunFolderError(TrainError):
    """The output folder cannot hold this run, or cannot be rewound; the message says why."""


class RewindError(RunFolderError):
    """The run cannot be rewound to that point; the message says why and which points it can."""


def read_json(path: Path, default: Any) -> Any:
    return orjson.loads(path.read_bytes()) if path.is_file() else default


def _what_is_trained(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's dump without the keys a resumed run may change."""
    kept = copy.deepcopy(plan)
    for dotted in RESUMABLE_CHANGES:
        _drop(kept, dotted.split("."))
    return kept


def _drop(section: Any, path: list[str]) -> None:
    """Remove the key at `path` from a plan's dump in place; `name[]` is every item of the list `name`."""
    if not isinstance(section, dict):
        return
    name, rest = path[0], path[1:]
    if not rest:
        section.pop(name, None)
    elif name.endswith("[]"):
        for item in section.get(name[:-2]) or []:
            _drop(item, rest)
    else:
        _drop(section.get(name), rest)


def _as_current(saved: dict[str, Any]) -> dict[str, Any]:
    """A run's saved plan as this version of rollgym reads it: keys renamed since under their new names,
    keys added since at their defaults, so that a run started before either is still the same plan."""
    renamed_keys(saved)
    try:
        return Plan.model_validate(saved).model_dump(mode="json")
    except ValueError:  # a ValidationError too
        return saved  # compared as it is: the message then names the keys that differ


def _weights(*artefacts: dict[str, Any] | None) -> list[str]:
    """The files of artefacts' weights (local ones)."""
    paths = []
    for artefact in artefacts:
        for key in ("uri", "serving_uri"):
            uri = (artefact or {}).get(key)
            if uri and "://" not in uri:  # a remote job's uri is not ours to check
                paths.append(uri)
    return paths


class RunFolder:
    """One run's output folder; `unit` is what its history counts ("epoch", or "step" in async mode)."""

    def __init__(self, root: Path, unit: str) -> None:
        self.root = root
        self.unit = unit
        self.state_path = root / STATE_FILE
        self.history_path = root / HISTORY_FILE

    def unit_dir(self, number: int) -> Path:
        """The folder of an epoch (of a step, in async mode)."""
        return self.root / f"{self.unit}-{number:03d}"

    def holds_other_files(self) -> bool:
        """The folder exists with files in it but no plan.json: not a run to continue."""
        return not (self.root / PLAN_FILE).is_file() and self.root.is_dir() and any(self.root.iterdir())

    # ------------------------------------------------------------------ the plan

    def claim(self, plan: dict[str, Any]) -> None:
        """Make the folder this plan's: new, or a run of the same plan to continue (a history line torn by
        a kill is dropped). RunFolderError when it is a file or holds a run of another plan."""
        problem = self.refusal(plan)
        if problem is not None:
            raise RunFolderError(problem)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "serving").mkdir(exist_ok=True)
        write_json_atomic(self.root / PLAN_FILE, plan)
        self.drop_torn_history()

    def refusal(self, plan: dict[str, Any]) -> str | None:
        """Why `claim(plan)` would refuse the folder (None: it would take it); reads, never writes."""
        if self.root.exists() and not self.root.is_dir():
            return f"output: {self.root} is a file; a run's output is a folder"
        saved = read_json(self.root / PLAN_FILE, None)
        if saved is not None:
            saved = _as_current(saved)
        if saved is not None and _what_is_trained(saved) != _what_is_trained(plan):
            changed = sorted(k for k in set(saved) | set(plan)
                             if _what_is_trained({k: saved.get(k)}) != _what_is_trained({k: plan.get(k)}))
            return (f"{self.root} holds a run of another plan (keys differ: {', '.join(changed)}); "
                    "use another output folder (a resumed run may change only "
                    f"{', '.join(RESUMABLE_CHANGES)})")
        return None

    def discard_new(self, existed: bool) -> None:
        """Take back a claim that started nothing (a run whose stack failed to start): a folder the claim made
        is removed, one that was there already is left as it was (empty, or holding no run). Only a new run's:
        a run being resumed is never touched."""
        if not existed:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        (self.root / PLAN_FILE).unlink(missing_ok=True)
        shutil.rmtree(self.root / "serving", ignore_errors=True)

    def holds_run(self) -> bool:
        """A run was started in the folder (its plan.json is there)."""
        return (self.root / PLAN_FILE).is_file()

    # ------------------------------------------------------------------ state and history

    def read_state(self) -> dict[str, Any]:
        return read_json(self.state_path, {"applied": None, "best": None, "last": None, "stopped": None})

    def save_state(self, state: dict[str, Any]) -> None:
        write_json_atomic(self.state_path, state)

    def history(self) -> list[dict[str, Any]]:
        return read_whole_lines(self.history_path)

    def append_history(self, line: dict[str, Any], state: dict[str, Any]) -> None:
        """Finish an epoch (step): the run's state saved in its folder (what `--rewind` restores), then its
        line appended to history.jsonl and flushed to disk."""
        folder = self.unit_dir(int(line["epoch"]))
        folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(folder / STATE_FILE, state)
        with self.history_path.open("ab") as handle:
            handle.write(orjson.dumps(line) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())

    def drop_torn_history(self) -> None:
        """A line cut short by a kill would swallow the next one appended after it: keep whole lines only."""
        if not self.history_path.is_file():
            return
        whole = self.history()
        if b"".join(orjson.dumps(line) + b"\n" for line in whole) != self.history_path.read_bytes():
            write_jsonl_atomic(self.history_path, whole)

    # ------------------------------------------------------------------ rewinding

    def _unrestorable(self, number: int, keep_last: int | None, rebuildable: bool) -> str | None:
        """Why the state saved in a finished epoch's folder cannot be restored (None: it can). A merged
        GGUF that is gone while the weights it was exported from are kept is not a reason when it can be
        rebuilt."""
        saved = self.unit_dir(number) / STATE_FILE
        if not saved.is_file():
            return f"{saved} is missing (the run predates rewinding)"
        state = orjson.loads(saved.read_bytes())
        for artefact in (state.get("applied"), state.get("last")):
            for path in _weights(artefact):
                if Path(path).exists() or (rebuildable and path == (artefact or {}).get("serving_uri")
                                           and Path(str(artefact.get("uri"))).exists()):
                    continue
                why = (f"pruned (checkpoints.keep_last: {keep_last} keeps the last {keep_last} steps' weights; "
                       "checkpoints.every keeps every Nth)" if keep_last else "gone (removed outside rollgym)")
                return f"its weights {path} are {why}"
        return None

    def rewind_problem(self, to: int, keep_last: int | None = None, rebuildable: bool = True) -> str | None:
        """Why the run cannot be rewound to the end of its epoch (step) `to` (None: it can), with the ones it can;
        reads, never writes. `rebuildable`: a pruned merged GGUF can be written again from its kept weights."""
        unit = self.unit
        finished = sorted({int(line["epoch"]) for line in self.history() if "epoch" in line})
        if to not in finished:
            shown = f"{finished[0]}..{finished[-1]}" if finished else "none"
            return f"{self.root}: {unit} {to} is not a finished {unit} of this run (finished: {shown})"
        problem = self._unrestorable(to, keep_last, rebuildable)
        if problem is None:
            return None
        possible = [n for n in finished if self._unrestorable(n, keep_last, rebuildable) is None]
        return (f"cannot rewind to {unit} {to}: {problem}; {unit}s it can rewind to: "
                f"{', '.join(map(str, possible)) or 'none'}")

    def rewind(self, to: int, log: Callable[[str], None] = print, *, keep_last: int | None = None,
               rebuild: Callable[[dict[str, Any]], None] | None = None) -> Path:
        """Rewind the run to the end of its epoch (step) `to`; the folder that now holds what came after it.
        `keep_last` is the plan's `checkpoints.keep_last` (to say why weights are gone); `rebuild(artefact)`
        writes an artefact's merged GGUF (`serving_uri`) again from its kept weights (`uri`)."""
        unit = self.unit
        history = self.history()
        problem = self.rewind_problem(to, keep_last, rebuild is not None)
        if problem is not None:
            raise RewindError(problem)
        state = orjson.loads((self.unit_dir(to) / STATE_FILE).read_bytes())
        if rebuild is not None:
            self._rebuild_merged(state, rebuild, log)
        aside = self.root / "rewound" / f"after-{unit}-{to:03d}-{time.strftime('%Y%m%d-%H%M%S')}"
        aside.mkdir(parents=True)
        moved = 0
        pattern = re.compile(rf"^{unit}-(\d+)$")
        for path in sorted(self.root.iterdir()):
            match = pattern.match(path.name)
            if match and int(match.group(1)) > to:
                shutil.move(str(path), aside / path.name)
                moved += 1
        steps = self.root / "orchestrator" / "steps"  # an async run's published batches after the step
        if steps.is_dir():
            for path in sorted(steps.iterdir()):
                match = re.match(r"^\.?step_(\d+)(\.tmp)?$", path.name)
                if match and int(match.group(1)) > to:
                    (aside / "orchestrator-steps").mkdir(exist_ok=True)
                    shutil.move(str(path), aside / "orchestrator-steps" / path.name)
        kept = [line for line in history if int(line.get("epoch", 0)) <= to]
        later = [line for line in history if int(line.get("epoch", 0)) > to]
        write_jsonl_atomic(aside / HISTORY_FILE, later)
        write_jsonl_atomic(self.history_path, kept)
        state["stopped"] = None
        best = (state.get("best") or {}).get("artefact")
        if any(not Path(path).exists() for path in _weights(best)):
            # Pruned since (checkpoints.every keeps the step, not an older best): the guard starts over here.
            log(f"the best model as of {unit} {to} was pruned since: the guard compares with later {unit}s only")
            state["best"] = None
        write_atomic(self.state_path, orjson.dumps(state, option=orjson.OPT_INDENT_2))
        log(f"rewound to {unit} {to}: {moved} later {unit} folder(s) and {len(later)} history line(s) moved to {aside}")
        return aside

    @staticmethod
    def _rebuild_merged(state: dict[str, Any], rebuild: Callable[[dict[str, Any]], None],
                        log: Callable[[str], None]) -> None:
        """Write again the merged GGUFs the restored state serves (applied, last, best) that were pruned
        while the weights they came from were kept."""
        artefacts = [state.get("applied"), state.get("last"), (state.get("best") or {}).get("artefact")]
        done: set[str] = set()
        for artefact in artefacts:
            target = (artefact or {}).get("serving_uri")
            if (not target or target in done or "://" in target or Path(target).exists()
                    or not Path(str(artefact.get("uri"))).exists()):
                continue
            started = time.perf_counter()
            rebuild(artefact)
            done.add(target)
            log(f"rebuilt {target} from {artefact['uri']} in {time.perf_counter() - started:.1f} s")

    # ------------------------------------------------------------------ pruning

    def prune(self, state: dict[str, Any], keep_last: int | None, every: int | None) -> None:
        """Delete what no resume or guard can need: merged GGUFs that are neither applied, last nor the
        best (each is hundreds of MB), and with `keep_last: N` the weights and trainer state of steps
        older than the last N (their artefact.json stays: a finished step is never redone), except every
        `every`-th step's, kept to rewind to."""
        kept: set[str] = set()
        best = (state.get("best") or {}).get("artefact")
        for artefact in (state.get("applied"), state.get("last"), best):
            for uri in (artefact or {}).get("uri"), (artefact or {}).get("serving_uri"):
                if uri:
                    kept.add(str(Path(uri).resolve()))

        def rewindable(train: Path) -> bool:  # every Nth step's weights stay, to rewind to
            number = train.parent.name.rpartition("-")[2]
            return bool(every) and number.isdigit() and int(number) % every == 0

        for path in self.root.glob("*-*/train/policy-*.gguf"):
            if str(path.resolve()) not in kept and not rewindable(path.parent):
                path.unlink(missing_ok=True)
        if not keep_last:
            return
        finished = sorted(train for train in self.root.glob("*-*/train") if (train / ARTEFACT_FILE).is_file())
        for train in finished[:-keep_last]:
            if rewindable(train) or any(uri.startswith(str(train.resolve()) + os.sep) for uri in kept):
                continue
            for name in ("checkpoint", "adapter"):
                shutil.rmtree(train / name, ignore_errors=True)
            for path in train.glob("*.gguf"):
                path.unlink(missing_ok=True)


__all__ = ["HISTORY_FILE", "PLAN_FILE", "RESUMABLE_CHANGES", "STATE_FILE", "RewindError", "RunFolder",
           "RunFolderError", "read_json"]
