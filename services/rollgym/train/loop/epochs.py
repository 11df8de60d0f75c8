"""`rollgym train PLAN.yaml`: epochs of collect → curate → optimize → apply → validate.

Each phase's result is recorded in the epoch's `phases.json` as it finishes, so that killing the command
and running it again continues where it stopped (`run_folder.py` has the folder's layout): collection
resumes by rollout_id (the collector's own resume), a finished optimize is not redone (its artefact.json
exists), and the last applied artefact is applied again on start.

The phases live beside this module: `collect` (and `validation`), `curation`, `optimize`, `apply`, and
`guard`; `history` records each finished epoch.
"""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import orjson
from tqdm import tqdm

from ...data.jsonl import read_whole_lines, write_json_atomic
from ...traces.sources import SourceError, read_source
from ..trainers.base import Artefact, TrainingFailed
from ..trainers.jobs import finished_artefact
from ..trainers.progress import describe
from .apply import Serving
from .collect import Collections
from .curation import Curated, CurationError, curate
from .dynamic_sampling import epoch_files
from .errors import TrainError
from .guard import Guard
from .history import History
from .optimize import Trainers, step_config
from .plan import Plan, StageConfig
from .run_folder import RunFolder, read_json
from .teacher import TeacherError, score_records
from .validation import Validation

PHASES = ("collect", "curate", "optimize", "apply", "validate")
# What an epoch's history line keeps of its collection beside the reward (dynamic_sampling: its refills).
TRAIN_KEYS = ("temperature", "dynamic_sampling")
# Curation drops that mean "these rollouts teach nothing" (every group solved or failed alike, no
# success to imitate), not "these rollouts are unusable": an epoch left with only these trains no
# step and keeps the served model, instead of stopping the run.
NO_SIGNAL = frozenset({"below_min_reward", "zero_reward_spread", "low_reward_spread", "unpaired", "not_top_k",
                       "curriculum", "duplicate_prompt", "tool_error", "repetition", "gibberish"})


class PhaseBar:
    """A tqdm line for a phase (curate, optimize, apply); optimize shows the trainer's steps as they come
    (`step 3/10, 416 tokens/s, loss 0.4100`: trainers/progress.py)."""

    def __init__(self, epoch: int, phase: str, enabled: bool) -> None:
        self.bar = tqdm(total=1, desc=f"epoch {epoch} {phase:<8}", disable=not enabled, leave=True,
                        bar_format="{desc} {bar:10} {elapsed} {postfix}", file=sys.stderr)
        self.shown: Any = None

    def tick(self, progress: dict[str, Any] | None = None) -> None:
        """Keep the line's clock going; with a trainer's progress, show its step, throughput and loss (a log
        file gets a line for each new step, a terminal the clock too)."""
        if progress is not None and progress.get("step") != self.shown:
            self.shown = progress.get("step")
            self.bar.total = max(1, int(progress["steps"]))
            self.bar.n = min(int(progress["step"]), self.bar.total)
            self.bar.set_postfix_str(describe(progress), refresh=False)
            self.bar.refresh()
        elif sys.stderr.isatty():
            self.bar.refresh()

    def done(self, **postfix: Any) -> None:
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.n = self.bar.total
        self.bar.close()

    def fail(self, cause: str) -> None:
        """Close the line on the cause's first line (the full error follows it), never on a vaguer summary."""
        first = cause.splitlines()[0] if cause else "failed"
        self.bar.set_postfix_str(f"failed: {first[:160]}", refresh=False)
        self.bar.close()


class TrainLoop:
    """A plan's stages, epoch by epoch, over the run folder `plan.output`."""

    unit = "epoch"  # what history.jsonl counts, and the prefix of its folders

    def __init__(self, plan: Plan, *, progress: bool = True, log: Callable[[str], None] | None = None,
                 rewind_to: int | None = None) -> None:
        self.plan = plan
        self.rewind_to = rewind_to  # continue from the end of this epoch (step), moving later ones aside
        self.progress = progress
        self.log = log or (lambda message: print(f"rollgym: {message}", file=sys.stderr))
        self.output = Path(plan.output)
        self.folder = RunFolder(self.output, self.unit)
        self.serving = Serving(plan, self.output / "serving")
        self.collections = Collections(plan, self.serving, progress=progress, log=self.log)
        self.validation = Validation(self.collections)
        self.trainers = Trainers()
        self.state: dict[str, Any] = {}
        self.guard = Guard(plan.guard, self.log)
        self.records = History(self.folder, plan.tracking, self.log, step_plots=self.unit == "step")

    # ------------------------------------------------------------------ state

    def history(self) -> list[dict[str, Any]]:
        return self.records.lines()

    @property
    def history_path(self) -> Path:
        return self.folder.history_path

    def _save_state(self) -> None:
        self.folder.save_state(self.state)

    def _artefact(self, key: str) -> Artefact | None:
        data = self.state.get(key)
        return Artefact.model_validate(data) if data else None

    def _apply_mode(self) -> str:
        """The apply mode the serving side runs in (a plan uses one for all its stages: Plan checks it)."""
        modes = {stage.apply for stage in self.plan.stages} - {"none"}
        return modes.pop() if modes else "none"

    def _claim_output(self) -> None:
        """Make the output folder this plan's (new, or a run of the same plan to continue), rewound if asked."""
        self.folder.claim(self.plan.model_dump(mode="json"))
        if self.rewind_to is not None:
            self.folder.rewind(self.rewind_to, self.log, keep_last=self.plan.checkpoints.keep_last,
                               rebuild=self._rebuild_merged)

    def _rebuild_merged(self, artefact: dict[str, Any]) -> None:
        """Write an artefact's merged GGUF again from the weights its step kept (a rewind to a step whose
        GGUF was pruned: every merged GGUF but the applied, last and best ones is)."""
        from ..trainers.gguf_export import rebuild_merged_gguf

        try:
            rebuild_merged_gguf(artefact["base_model"], artefact["uri"], artefact["serving_uri"], self.plan.serve_dtype)
        except (OSError, ValueError) as exc:
            raise TrainError(f"rewind: cannot rebuild {artefact['serving_uri']} from {artefact['uri']}: {exc}") from None

    def _finish(self, line: dict[str, Any]) -> None:
        self.records.record(line, self.state)

    def prune(self) -> None:
        self.folder.prune(self.state, self.plan.checkpoints.keep_last, self.plan.checkpoints.every)

    def release(self) -> None:
        """Stop the run's trainer processes and close its tracker."""
        self.trainers.close()
        self.records.close()

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        plan = self.plan
        new, existed = not self.folder.holds_run(), self.output.exists()
        self._claim_output()
        self.state = self.folder.read_state()
        if self.state.get("stopped"):
            self.log(f"this run has stopped already: {self.state['stopped']}")
            return self.state
        mode = self._apply_mode()
        tqdm.monitor_interval = 0  # no monitor thread: the launcher forks servers only from a single thread
        self._start_serving(mode, new, existed)
        try:
            applied = self._artefact("applied")
            if self.plan.policies:
                from .policy_epochs import serve_applied

                serve_applied(self)
            elif applied is not None:
                self.log(f"resuming: applying {applied.version} again")
                self.serving.apply(applied, mode)
            done = {int(line["epoch"]) for line in self.history()}
            if plan.validation is not None and 0 not in done:
                self._epoch_zero()
            for epoch, stage in plan.epochs():
                if epoch in done:
                    continue
                self._epoch(epoch, stage, mode)
                if self.state.get("stopped"):
                    self.log(f"stopped: {self.state['stopped']}")
                    break
        finally:
            self.release()
            self.serving.stop()
        return self.state

    def _start_serving(self, mode: str, new: bool, existed: bool) -> None:
        """Start the stack (serving the base model, or the co-located trainer's); a new run whose stack does
        not start leaves no output folder behind."""
        started = time.perf_counter()
        try:
            self.serving.serve_base(mode, self.plan.base_model)
            self._colocate_trainer()
        except BaseException:
            self.serving.stop()
            self.records.close()
            if new:
                self.folder.discard_new(existed)
            raise
        self.log(f"stack ready in {time.perf_counter() - started:.1f} s")

    def _colocate_trainer(self) -> None:
        """Under colocate: true the grpo steps run inside the policy server (colocate.py)."""
        if self.plan.colocate:
            from .colocate import ColocatedTrainer

            for name in ("grpo", "trl_grpo"):
                self.trainers.instances[name] = ColocatedTrainer(self.serving)

    def _epoch_zero(self) -> None:
        folder = self.folder.unit_dir(0)
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        summary = self.validation.validate(0, folder)
        line = {"epoch": 0, "stage": None, "model_version": self.serving.version, "artefact": None,
                "validation": summary, "phases_s": {"validate": round(time.perf_counter() - started, 3)}}
        if self.plan.policies:
            from .policy_epochs import zero_line

            line["policies"] = zero_line(self, summary)
        self.guard.remember_best(self.state, summary, None, self.serving.version)
        self._save_state()
        self._finish(line)

    # ------------------------------------------------------------------ one epoch

    def _epoch(self, epoch: int, stage: StageConfig, mode: str) -> None:
        if self.plan.policies:  # several policies: one collection, then each policy on its own
            from .policy_epochs import run_epoch

            run_epoch(self, epoch, stage)
            return
        folder = self.folder.unit_dir(epoch)
        folder.mkdir(parents=True, exist_ok=True)
        phases_path = folder / "phases.json"
        phases: dict[str, Any] = read_json(phases_path, {})
        epoch_started = time.perf_counter()

        def finish(name: str, result: dict[str, Any], seconds: float) -> None:
            phases[name] = {**result, "s": round(seconds, 3)}
            write_json_atomic(phases_path, phases)

        version = phases.get("collect", {}).get("model_version", self.serving.version)
        if "collect" not in phases:
            t = time.perf_counter()
            level = self._level(stage)
            summary = self.collections.collect(epoch, stage, folder, level)
            finish("collect", {"model_version": version, "summary": summary, "level": level},
                   time.perf_counter() - t)

        if "curate" not in phases:
            t = time.perf_counter()
            finish("curate", self._curate_phase(epoch, stage, folder, version), time.perf_counter() - t)
        if phases["curate"].get("skipped"):
            line = self._skipped_line(epoch, stage, phases)
            self._advance(stage, line, phases["collect"].get("level", 0))
            self._finish(line)
            return

        artefact = finished_artefact(folder / "train")  # a step that finished is never redone
        if artefact is None:
            t = time.perf_counter()
            artefact = self._optimize(epoch, stage, folder, mode)
            finish("optimize", {"artefact": artefact.model_dump()}, time.perf_counter() - t)
        elif "optimize" not in phases:  # it finished, the loop died before recording it
            finish("optimize", {"artefact": artefact.model_dump()}, 0.0)
        self.state["last"] = artefact.model_dump()
        self._save_state()

        if "apply" not in phases:
            bar = PhaseBar(epoch, "apply", self.progress)
            seconds = self.serving.apply(artefact, stage.apply)
            if stage.apply != "none":
                self.state["applied"] = artefact.model_dump()
                self._save_state()
            bar.done(version=self.serving.version, s=f"{seconds:.2f}")
            synced = self.serving.full.last if stage.apply == "weights" and self.serving.full else None
            finish("apply", {"mode": stage.apply, "model_version": self.serving.version,
                             **({"weights": synced.summary()} if synced else {})}, seconds)

        validation = None
        verdict = None
        if self.validation.due(epoch):
            if "validate" not in phases:
                t = time.perf_counter()
                finish("validate", {"summary": self.validation.validate(epoch, folder)}, time.perf_counter() - t)
            validation = phases["validate"]["summary"]
            verdict = self.guard.check(self.state, validation, artefact, self.serving.version,
                                       lambda best: self._restore(best, mode))
            self._save_state()
        self.prune()
        collected = phases["collect"]["summary"]
        line = {
            "epoch": epoch, "stage": stage.name, "model_version": self.serving.version,
            "artefact": artefact.uri, "serving": artefact.serving_uri,
            "train": {"mean_reward": collected.get("mean_reward"),
                      **{k: v for k, v in collected.items() if k.startswith("pass@") or k in TRAIN_KEYS},
                      "rollouts": collected.get("rollouts"), "failed": collected.get("failed"),
                      **artefact.metrics},
            "curated": {k: v for k, v in phases["curate"].items() if k != "s"},
            **({"weights": phases["apply"]["weights"]} if "weights" in phases.get("apply", {}) else {}),
            "validation": validation, "guard": verdict,
            "phases_s": {name: phases[name]["s"] for name in PHASES if name in phases},
            "overhead_s": self._overhead(phases),
            "wall_s_this_run": round(time.perf_counter() - epoch_started, 3),
        }
        self._advance(stage, line, phases["collect"].get("level", 0))
        self._finish(line)

    def _restore(self, best: Artefact | None, mode: str) -> str | None:
        """The guard's way back: serve the best model again; the version it is served as."""
        self.serving.apply(best, mode)
        return self.serving.version

    # ------------------------------------------------------------------ curate

    def _curate_phase(self, epoch: int, stage: StageConfig, folder: Path, version: str | None) -> dict[str, Any]:
        """Curate the epoch's rollouts into curated.jsonl; the phase's result (skipped: nothing to learn)."""
        bar = PhaseBar(epoch, "curate", self.progress)
        try:
            curated = self._curate_epoch(epoch, stage, folder, version)
            dropped = curated.summary()["dropped"]
            if not curated.records and not set(dropped) <= NO_SIGNAL:
                raise CurationError(f"epoch {epoch} ({stage.name}): nothing left to train on after curation "
                                    f"({dropped})" + "".join(f"; {note}" for note in curated.notes))
        except (CurationError, SourceError) as exc:
            bar.fail(str(exc))
            raise TrainError(str(exc)) from None
        scored = None
        if stage.teacher is not None and curated.records:  # every trained token, scored by the teacher
            try:
                scored = score_records(curated.records, stage.teacher, self.serving.registry)
            except TeacherError as exc:
                raise TrainError(f"epoch {epoch} ({stage.name}) curate: {exc}") from None
        with (folder / "curated.jsonl").open("wb") as handle:
            for record in curated.records:
                handle.write(orjson.dumps(record) + b"\n")
        result = curated.summary() | ({"teacher": scored} if scored else {})
        if not curated.records:
            result["skipped"] = f"nothing to learn from: the rollouts were usable, but {dropped}"
            self.log(f"epoch {epoch} ({stage.name}): no training step: {result['skipped']}; the served model stays")
        bar.done(records=len(curated.records), dropped=sum(curated.dropped.values()))
        return result

    def _curate_epoch(self, epoch: int, stage: StageConfig, folder: Path, version: str | None) -> Curated:
        """The epoch's live rollouts (on-policy: of the served version) and the stage's replayed ones
        (any version: off-policy by design), curated alike; one set of records."""
        kind = stage.optimize.data or "sft"
        where = f"epoch {epoch} ({stage.name})"
        rollouts = [row for file in epoch_files(folder) for row in read_whole_lines(file)]  # refills too
        live = curate(rollouts, kind, stage.curate, epoch=epoch - 1,
                      version=version, group_size=stage.collect.repeats if stage.collect else None, stage=where)
        if not stage.replay:
            return live
        read = [read_source(entry, kind, self.plan.base_model) for entry in stage.replay]  # files, trace:// sources
        rows = [row for replay in read for row in replay.rows]
        replayed = curate(rows, kind, stage.curate, epoch=epoch - 1, stage=f"{where} replay")
        # what the sources themselves dropped (unscored, below min_reward, failed episodes) counts with the rest
        by_sources = sum((replay.dropped for replay in read), Counter())
        return Curated(kind, live.records + replayed.records + [r for replay in read for r in replay.records],
                       live.rollouts_in + replayed.rollouts_in,
                       live.rollouts_kept + replayed.rollouts_kept, live.dropped + replayed.dropped + by_sources,
                       replayed=replayed.rollouts_in, segments=live.segments + replayed.segments,
                       segments_left_out=live.segments_left_out + replayed.segments_left_out,
                       notes=[note for replay in read for note in replay.notes])

    # ------------------------------------------------------------------ optimize

    def _optimize(self, epoch: int, stage: StageConfig, folder: Path, mode: str) -> Artefact:
        previous = self._artefact("applied") if mode != "none" else self._artefact("last")
        trainer = stage.optimize.trainer
        config = step_config(self.plan, stage.optimize, folder, f"policy-e{epoch:03d}", epoch, previous,
                             export_gguf=self.plan.serve_dtype if stage.apply == "merged" else "none")
        bar = PhaseBar(epoch, "optimize", self.progress)
        try:
            artefact = self.trainers.train(trainer, folder / "curated.jsonl", config, bar.tick)
        except (TrainingFailed, ValueError) as exc:
            bar.fail(str(exc))
            raise TrainError(f"epoch {epoch} ({stage.name}) optimize with {trainer}: {exc}") from None
        loss = artefact.metrics.get("train_loss", artefact.metrics.get("loss", math.nan))  # TRL's name, grpo's
        bar.done(loss=f"{loss:.4f}", steps=int(artefact.metrics.get("steps", 0)))
        return artefact

    # ------------------------------------------------------------------ the epoch's line

    def _level(self, stage: StageConfig) -> int:
        """The difficulty level a stage collects from now (0 without levels)."""
        return int(self.state.get("levels", {}).get(stage.name, 0))

    def _advance(self, stage: StageConfig, line: dict[str, Any], level: int) -> None:
        """A stage with levels moves to the next one once an epoch's reward on its level (the one it
        collected from) or its validation reaches advance_at. The level is part of the saved state, so a
        resume keeps it, and an epoch finished twice (a kill before its history line) advances once."""
        collect = stage.collect
        if collect is None or not collect.levels:
            return
        line["level"] = level
        section = line.get("validation") if collect.advance_on == "validation" else line.get("train")
        reward = (section or {}).get("mean_reward")
        if (reward is not None and reward >= collect.advance_at and level + 1 < len(collect.levels)
                and self._level(stage) <= level):
            self.state.setdefault("levels", {})[stage.name] = level + 1
            self._save_state()
            self.log(f"{stage.name}: {collect.advance_on} reward {reward:.3f} reached {collect.advance_at}: "
                     f"level {level + 2} of {len(collect.levels)} ({collect.levels[level + 1]}) from the next epoch")

    def _skipped_line(self, epoch: int, stage: StageConfig, phases: dict[str, Any]) -> dict[str, Any]:
        """The history line of an epoch whose data held no learning signal: no step, no new model."""
        collected = phases["collect"]["summary"]
        return {
            "epoch": epoch, "stage": stage.name, "model_version": self.serving.version, "artefact": None,
            "skipped": phases["curate"]["skipped"],
            "train": {"mean_reward": collected.get("mean_reward"),
                      **{k: v for k, v in collected.items() if k.startswith("pass@") or k in TRAIN_KEYS},
                      "rollouts": collected.get("rollouts"), "failed": collected.get("failed")},
            "curated": {k: v for k, v in phases["curate"].items() if k not in ("s", "skipped")},
            "validation": None, "guard": None,
            "phases_s": {name: phases[name]["s"] for name in PHASES if name in phases},
            "overhead_s": self._overhead(phases),
        }

    def _overhead(self, phases: dict[str, Any]) -> float:
        """The loop's own seconds: everything but generation (collect, validate) and the trainer's
        train() call: curation, the trainer's start and model load, the GGUF export, apply."""
        optimize = phases.get("optimize", {})
        train_s = optimize.get("artefact", {}).get("metrics", {}).get("train_s", 0.0)
        return round(phases.get("curate", {}).get("s", 0.0) + phases.get("apply", {}).get("s", 0.0)
                     + max(0.0, optimize.get("s", 0.0) - train_s), 3)


def run_plan(plan: Plan, *, progress: bool = True) -> dict[str, Any]:
    return TrainLoop(plan, progress=progress).run()


__all__ = ["PHASES", "TrainError", "TrainLoop", "run_plan"]
