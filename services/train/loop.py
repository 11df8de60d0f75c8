"""`rollgym train PLAN.yaml`: epochs of collect → curate → optimize → apply → validate.

The output folder holds everything, so that killing the command and running it again continues
where it stopped:

    OUTPUT/plan.json              the validated plan the run started with
    OUTPUT/state.json             the applied artefact, the best validated one, whether the run stopped
    OUTPUT/history.jsonl          one line per finished epoch (epoch 0: the base model's validation)
    OUTPUT/reward.png             train and validation reward per epoch
    OUTPUT/serving/               the GGUF the embedded model serves (apply: merged)
    OUTPUT/epoch-NNN/phases.json  each finished phase's result; a finished phase is not redone
    OUTPUT/epoch-NNN/rollouts.jsonl, curated.jsonl, train/ (artefact.json, adapter/, train.log),
                     validation.jsonl

Collection resumes by rollout_id (the collector's own resume), a finished optimize is not redone
(its artefact.json exists), and the last applied artefact is applied again on start.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import orjson
from tqdm import tqdm

from ..client import ServerClient
from ..rollouts.collector import CollectOptions, Collector
from .curation import Curated, CurationError, curate, on_policy
from .jobs import ARTEFACT_FILE, SubprocessJob, finished_artefact
from .plan import RL_ADAPTERS, Plan, StageSection, trainer_args, validation_environments
from .rewind import STATE_FILE, RewindError, rewind
from .serving import Serving
from .tracking import Tracker
from .trainers import Artefact, RemoteTrainer, TrainConfig, TrainingFailed, load_adapter

PHASES = ("collect", "curate", "optimize", "apply", "validate")
# Curation drops that mean "these rollouts teach nothing" (every group solved or failed alike, no
# success to imitate), not "these rollouts are unusable": an epoch left with only these trains no
# step and keeps the served model, instead of stopping the run.
NO_SIGNAL = frozenset({"below_min_reward", "zero_reward_spread", "low_reward_spread", "unpaired", "not_top_k",
                       "curriculum", "duplicate_prompt", "tool_error"})


class TrainError(RuntimeError):
    """The run cannot go on; the message says which epoch and phase, and why."""


def write_json(path: Path, data: Any) -> None:
    partial = path.with_name(path.name + ".tmp")
    partial.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    partial.replace(path)


def read_json(path: Path, default: Any) -> Any:
    return orjson.loads(path.read_bytes()) if path.is_file() else default


# What a resumed run may change: how rollouts are retried and filtered, how the run is guarded,
# tracked and pruned; never what the steps already taken trained on or toward.
RESUMABLE_CHANGES = ("stack.concurrency", "stack.timeout_s", "stack.max_attempts", "stack.budget_s",
                     "orchestrator.difficulty", "orchestrator.max_drops_per_step", "orchestrator.concurrency",
                     "orchestrator.timeout_s", "orchestrator.max_attempts", "orchestrator.budget_s",
                     "guard", "tracking", "checkpoints")


def _what_is_trained(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's dump without the keys a resumed run may change."""
    kept = {key: dict(value) if isinstance(value, dict) else value for key, value in plan.items()}
    for dotted in RESUMABLE_CHANGES:
        section, _, key = dotted.partition(".")
        if not key:
            kept.pop(section, None)
        elif isinstance(kept.get(section), dict):
            kept[section].pop(key, None)
    return kept


def _is_json(line: bytes) -> bool:
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        return False
    return True


def read_rollouts(path: Path) -> list[dict[str, Any]]:
    """Finished rollouts of a collection (a torn last line, from a kill, is left out)."""
    rows = []
    if path.is_file():
        for line in path.read_bytes().splitlines():
            try:
                rows.append(orjson.loads(line))
            except orjson.JSONDecodeError:
                continue
    return rows


def _counts(counts: Any) -> str:
    return ", ".join(f"{status}: {n}" for status, n in counts.items()) if isinstance(counts, dict) else "?"


def _first_failure(path: str | None) -> str:
    """The cause of the first failed attempt in a collection's failures file."""
    rows = read_rollouts(Path(path)) if path else []
    return str(rows[0].get("error") or rows[0].get("status")) if rows else "no cause recorded"


class PhaseBar:
    """A tqdm line for a phase that has no natural progress (curate, optimize, apply)."""

    def __init__(self, epoch: int, phase: str, enabled: bool) -> None:
        self.bar = tqdm(total=1, desc=f"epoch {epoch} {phase:<8}", disable=not enabled, leave=True,
                        bar_format="{desc} {bar:10} {elapsed} {postfix}", file=sys.stderr)

    def tick(self) -> None:
        if sys.stderr.isatty():  # a log file gets the finished line only
            self.bar.refresh()

    def done(self, **postfix: Any) -> None:
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)
        self.bar.close()


class TrainLoop:
    unit = "epoch"  # what history.jsonl counts, and the prefix of its folders

    def __init__(self, plan: Plan, *, progress: bool = True, log: Callable[[str], None] | None = None,
                 rewind_to: int | None = None) -> None:
        self.plan = plan
        self.rewind_to = rewind_to  # continue from the end of this epoch (step), moving later ones aside
        self.progress = progress
        self.log = log or (lambda message: print(f"rollgym: {message}", file=sys.stderr))
        self.output = Path(plan.output)
        self.state_path = self.output / "state.json"
        self.history_path = self.output / "history.jsonl"
        self.serving = Serving(plan, self.output / "serving")
        self.state: dict[str, Any] = {}
        self.trainers: dict[str, Any] = {}  # one adapter instance per name for the run (grpo: one process)
        self.tracker: Tracker | None = None

    # ------------------------------------------------------------------ state

    def _save_state(self) -> None:
        write_json(self.state_path, self.state)

    def _artefact(self, key: str) -> Artefact | None:
        data = self.state.get(key)
        return Artefact.model_validate(data) if data else None

    def _apply_mode(self) -> str:
        """The apply mode the serving side runs in (a plan uses one for all its stages: Plan checks it)."""
        modes = {stage.apply for stage in self.plan.stages} - {"none"}
        return modes.pop() if modes else "none"

    def _claim_output(self) -> None:
        """Make the output folder this plan's: new, or a run of the same plan to continue."""
        if self.output.exists() and not self.output.is_dir():
            raise TrainError(f"output: {self.output} is a file; a run's output is a folder")
        self.output.mkdir(parents=True, exist_ok=True)
        (self.output / "serving").mkdir(exist_ok=True)
        saved = read_json(self.output / "plan.json", None)
        current = self.plan.model_dump(mode="json")
        if saved is not None and _what_is_trained(saved) != _what_is_trained(current):
            changed = sorted(k for k in set(saved) | set(current)
                             if _what_is_trained({k: saved.get(k)}) != _what_is_trained({k: current.get(k)}))
            raise TrainError(f"{self.output} holds a run of another plan (keys differ: {', '.join(changed)}); "
                             "use another output folder (a resumed run may change only "
                             f"{', '.join(RESUMABLE_CHANGES)})")
        write_json(self.output / "plan.json", current)
        self._drop_torn_history()
        if self.rewind_to is not None:
            try:
                rewind(self.output, self.rewind_to, self.unit, self.log)
            except RewindError as exc:
                raise TrainError(str(exc)) from None

    def _drop_torn_history(self) -> None:
        """A line cut short by a kill would swallow the next one appended after it: keep whole lines only."""
        if not self.history_path.is_file():
            return
        data = self.history_path.read_bytes()
        whole = [line for line in data.splitlines() if line.strip() and _is_json(line)]
        cleaned = b"".join(line + b"\n" for line in whole)
        if cleaned != data:
            partial = self.history_path.with_name(self.history_path.name + ".tmp")
            partial.write_bytes(cleaned)
            partial.replace(self.history_path)

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        plan = self.plan
        self._claim_output()
        self.state = read_json(self.state_path, {"applied": None, "best": None, "last": None, "stopped": None})
        if self.state.get("stopped"):
            self.log(f"this run has stopped already: {self.state['stopped']}")
            return self.state
        mode = self._apply_mode()
        tqdm.monitor_interval = 0  # no monitor thread: the launcher forks servers only from a single thread
        started = time.perf_counter()
        self.serving.serve_base(mode, plan.base_model)
        self.log(f"stack ready in {time.perf_counter() - started:.1f} s")
        try:
            applied = self._artefact("applied")
            if applied is not None:
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

    def trainer(self, adapter: str) -> Any:
        """The run's instance of an adapter: a long-lived one (grpo) keeps its process across steps."""
        if adapter not in self.trainers:
            self.trainers[adapter] = load_adapter(adapter)
        return self.trainers[adapter]

    def release(self) -> None:
        """Stop the run's trainer processes and close its tracker."""
        for instance in self.trainers.values():
            close = getattr(instance, "close", None)
            if callable(close):
                close()
        self.trainers.clear()
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def train(self, adapter: str, dataset: Path, config: TrainConfig, tick: Callable[[], None] | None = None) -> Artefact:
        """Run one optimize step through its adapter (in a child process or elsewhere) and record its
        artefact in the step's folder, so that a resumed run never trains or submits it again."""
        instance = self.trainer(adapter)
        if isinstance(instance, RemoteTrainer):
            job = instance.submit(dataset, config)
        else:  # a fit() trainer runs in a child process: its crash fails this step, not the loop
            job = SubprocessJob.start(adapter, dataset, config)
        while tick is not None and job.status() == "running":
            tick()
            time.sleep(0.2)
        artefact = job.wait()
        folder = Path(config.output_dir)
        if finished_artefact(folder) is None:  # a remote job leaves nothing here
            folder.mkdir(parents=True, exist_ok=True)
            write_json(folder / ARTEFACT_FILE, artefact.model_dump())
        return artefact

    def history(self) -> list[dict[str, Any]]:
        return read_rollouts(self.history_path)

    def _unit_dir(self, number: int) -> Path:
        """The folder of an epoch (of a step, in async mode)."""
        return self.output / f"{self.unit}-{number:03d}"

    def _append_history(self, line: dict[str, Any]) -> None:
        """Finish an epoch: its state saved in its folder (what `--rewind` restores), its line appended."""
        folder = self._unit_dir(int(line["epoch"]))
        folder.mkdir(parents=True, exist_ok=True)
        write_json(folder / STATE_FILE, self.state)
        with self.history_path.open("ab") as handle:
            handle.write(orjson.dumps(line) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        if self.tracker is None:
            self.tracker = Tracker(self.plan.tracking, self.output, self.log)
        self.tracker.log(line)
        try:
            from .plot import plot_history

            plot_history(self.history(), self.output / "reward.png")
        except Exception as exc:  # noqa: BLE001 - a plot must never stop training
            self.log(f"reward.png not drawn: {type(exc).__name__}: {exc}")

    def _epoch_zero(self) -> None:
        folder = self._unit_dir(0)
        folder.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        summary = self._validate(0, folder)
        line = {"epoch": 0, "stage": None, "model_version": self.serving.version, "artefact": None,
                "validation": summary, "phases_s": {"validate": round(time.perf_counter() - started, 3)}}
        self._remember_best(summary, None)
        self._save_state()
        self._append_history(line)

    # ------------------------------------------------------------------ one epoch

    def _epoch(self, epoch: int, stage: StageSection, mode: str) -> None:
        folder = self._unit_dir(epoch)
        folder.mkdir(parents=True, exist_ok=True)
        phases_path = folder / "phases.json"
        phases: dict[str, Any] = read_json(phases_path, {})
        epoch_started = time.perf_counter()

        def finish(name: str, result: dict[str, Any], seconds: float) -> None:
            phases[name] = {**result, "s": round(seconds, 3)}
            write_json(phases_path, phases)

        version = phases.get("collect", {}).get("model_version", self.serving.version)
        if "collect" not in phases:
            t = time.perf_counter()
            level = self._level(stage)
            summary = self._collect(epoch, stage, folder)
            finish("collect", {"model_version": version, "summary": summary, "level": level},
                   time.perf_counter() - t)

        if "curate" not in phases:
            t = time.perf_counter()
            bar = PhaseBar(epoch, "curate", self.progress)
            try:
                curated = self._curate_epoch(epoch, stage, folder, version)
                dropped = curated.summary()["dropped"]
                if not curated.records and not set(dropped) <= NO_SIGNAL:
                    raise CurationError(f"epoch {epoch} ({stage.name}): nothing left to train on after curation "
                                        f"({dropped})")
            except CurationError as exc:
                bar.done(error="nothing to train on")
                raise TrainError(str(exc)) from None
            with (folder / "curated.jsonl").open("wb") as handle:
                for record in curated.records:
                    handle.write(orjson.dumps(record) + b"\n")
            result = curated.summary()
            if not curated.records:
                result["skipped"] = f"nothing to learn from: the rollouts were usable, but {dropped}"
                self.log(f"epoch {epoch} ({stage.name}): no training step: {result['skipped']}; the served "
                         "model stays")
            bar.done(records=len(curated.records), dropped=sum(curated.dropped.values()))
            finish("curate", result, time.perf_counter() - t)
        if phases["curate"].get("skipped"):
            line = self._skipped_line(epoch, stage, phases)
            self._advance(stage, line, phases["collect"].get("level", 0))
            self._append_history(line)
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
            finish("apply", {"mode": stage.apply, "model_version": self.serving.version}, seconds)

        validation = None
        guard = None
        if self.plan.validation is not None and epoch % self.plan.validation.every == 0:
            if "validate" not in phases:
                t = time.perf_counter()
                finish("validate", {"summary": self._validate(epoch, folder)}, time.perf_counter() - t)
            validation = phases["validate"]["summary"]
            guard = self._guard(validation, artefact, mode)
        self.prune()
        wall = time.perf_counter() - epoch_started
        timings = {name: phases[name]["s"] for name in PHASES if name in phases}
        collected = phases["collect"]["summary"]
        line = {
            "epoch": epoch, "stage": stage.name, "model_version": self.serving.version,
            "artefact": artefact.uri, "serving": artefact.serving_uri,
            "train": {"mean_reward": collected.get("mean_reward"),
                      **{k: v for k, v in collected.items() if k.startswith("pass@")},
                      "rollouts": collected.get("rollouts"), "failed": collected.get("failed"),
                      **artefact.metrics},
            "curated": {k: v for k, v in phases["curate"].items() if k != "s"},
            "validation": validation, "guard": guard, "phases_s": timings,
            "overhead_s": self._overhead(phases),
            "wall_s_this_run": round(wall, 3),
        }
        self._advance(stage, line, phases["collect"].get("level", 0))
        self._append_history(line)

    def _curate_epoch(self, epoch: int, stage: StageSection, folder: Path, version: str | None) -> Curated:
        """The epoch's live rollouts (on-policy: of the served version) and the stage's replayed ones
        (any version: off-policy by design), curated alike; one set of records."""
        kind = stage.optimize.data or "sft"
        where = f"epoch {epoch} ({stage.name})"
        live = curate(read_rollouts(folder / "rollouts.jsonl"), kind, stage.curate, epoch=epoch - 1, version=version,
                      group_size=stage.collect.repeats if stage.collect else None, stage=where)
        if not stage.replay:
            return live
        rows = [row for file in stage.replay for row in read_rollouts(Path(file))]
        replayed = curate(rows, kind, stage.curate, epoch=epoch - 1, stage=f"{where} replay")
        return Curated(kind, live.records + replayed.records, live.rollouts_in + replayed.rollouts_in,
                       live.rollouts_kept + replayed.rollouts_kept, live.dropped + replayed.dropped,
                       replayed=replayed.rollouts_in)

    def _skipped_line(self, epoch: int, stage: StageSection, phases: dict[str, Any]) -> dict[str, Any]:
        """The history line of an epoch whose data held no learning signal: no step, no new model."""
        collected = phases["collect"]["summary"]
        return {
            "epoch": epoch, "stage": stage.name, "model_version": self.serving.version, "artefact": None,
            "skipped": phases["curate"]["skipped"],
            "train": {"mean_reward": collected.get("mean_reward"),
                      **{k: v for k, v in collected.items() if k.startswith("pass@")},
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

    # ------------------------------------------------------------------ phases

    def _collect(self, epoch: int, stage: StageSection, folder: Path) -> dict[str, Any]:
        if stage.collect is None:  # a replay-only stage trains offline
            return {"rollouts": 0, "failed": 0, "replay": list(stage.replay)}
        params = {**stage.collect.params, **self.serving.request_params()}
        tasks = Path(stage.collect.files[self._level(stage)])
        options = CollectOptions(input=tasks, output=folder / "rollouts.jsonl",
                                 repeats=stage.collect.repeats, limit=stage.collect.limit, params=params,
                                 progress=self.progress, **self._retries())
        return self._run_collection(options, f"epoch {epoch} collect")

    def _level(self, stage: StageSection) -> int:
        """The difficulty level a stage collects from now (0 without levels)."""
        return int(self.state.get("levels", {}).get(stage.name, 0))

    def _advance(self, stage: StageSection, line: dict[str, Any], level: int) -> None:
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

    def _validate(self, epoch: int, folder: Path) -> dict[str, Any]:
        section = self.plan.validation
        assert section is not None
        if section.suite is not None:
            return self._validate_suite(epoch, folder)
        options = CollectOptions(input=Path(section.input or ""), output=folder / "validation.jsonl",
                                 repeats=section.repeats, limit=section.limit,
                                 params={**section.params, **self.serving.request_params()},
                                 pass_threshold=section.pass_threshold, progress=self.progress, **self._retries())
        return self._validation_collection(epoch, options)

    def _validate_suite(self, epoch: int, folder: Path) -> dict[str, Any]:
        """Each environment of the validation suite into validation-ENV.jsonl; the summary is the mean over
        environments (mean_reward, and each pass@k they all have) beside every environment's own."""
        each = {}
        for env in validation_environments(self.plan):
            options = CollectOptions(input=env.tasks, output=folder / f"validation-{env.name}.jsonl",
                                     repeats=env.repeats, limit=env.limit,
                                     params={**env.params, **self.serving.request_params()},
                                     pass_threshold=env.pass_threshold, progress=self.progress, **self._retries())
            each[env.name] = self._validation_collection(epoch, options, env.agent)
        summary: dict[str, Any] = {"suite": self.plan.validation.suite if self.plan.validation else None}
        shared = set.intersection(*(set(k for k, v in s.items() if isinstance(v, (int, float))) for s in each.values()))
        for key in sorted(k for k in shared if k == "mean_reward" or k.startswith("pass@")):
            values = [s[key] for s in each.values() if s.get(key) is not None]
            summary[key] = sum(values) / len(values) if values else None
        summary["environments"] = each
        return summary

    def _validation_collection(self, epoch: int, options: CollectOptions, agent: str | None = None) -> dict[str, Any]:
        """One validation collection; every rollout must come from the model being validated."""
        summary = self._run_collection(options, f"epoch {epoch} validate", agent)
        version = self.serving.version
        stale = sum(1 for r in read_rollouts(options.output) if version is not None and not on_policy(r, version))
        if stale:
            raise TrainError(f"epoch {epoch} validate: {stale} rollouts came from another model version than "
                             f"{self.serving.version}")
        return summary

    def _retries(self) -> dict[str, Any]:
        """The stack section's concurrency, attempt timeout and retry bounds, for every collection."""
        stack = self.plan.stack
        return {"concurrency": stack.concurrency, "timeout_s": stack.timeout_s, "max_attempts": stack.max_attempts,
                "budget_s": stack.budget_s}

    def _run_collection(self, options: CollectOptions, label: str, agent: str | None = None) -> dict[str, Any]:
        if not options.input.is_file():
            raise TrainError(f"{label}: no such task file: {options.input}")
        agent = agent or self._agent()

        async def collect() -> dict[str, Any]:
            client = ServerClient(self.serving.registry, timeout_s=options.timeout_s, max_retries=2)
            try:
                return await Collector(client, agent, options, log=self.log).run()
            finally:
                await client.close()

        if self.progress:
            print(f"{label}:", file=sys.stderr)
        summary = asyncio.run(collect())
        if summary.get("failed") and not summary.get("rollouts"):
            # Not recorded as done: a rerun once the stack is right collects again instead of finding nothing.
            failures = summary.get("run", {}).get("failures")
            raise TrainError(f"{label}: every rollout failed ({_counts(summary.get('status_counts'))}), e.g. "
                             f"{_first_failure(failures)}; all causes in {failures}")
        keep = ("rollouts", "groups", "failed", "mean_reward", "reward_std", "status_counts")
        return {k: v for k, v in summary.items() if k in keep or k.startswith("pass@")}

    def _agent(self) -> str:
        wanted = self.plan.stack.agent
        agents = [name for name, address in self.serving.registry.items() if address.role in ("agents", "")]
        if wanted:
            if wanted not in self.serving.registry:
                raise TrainError(f"stack.agent: no server named {wanted!r} (agents: {', '.join(agents)})")
            return wanted
        if len(agents) != 1:
            raise TrainError(f"stack.agent: the stack has {len(agents)} agents ({', '.join(agents)}); name one")
        return agents[0]

    def _optimize(self, epoch: int, stage: StageSection, folder: Path, mode: str) -> Artefact:
        previous = self._artefact("applied") if mode != "none" else self._artefact("last")
        adapter = stage.optimize.adapter
        # A long-lived trainer keeps one seed (its RNG state carries on); a trainer per step gets its own.
        seed = self.plan.seed if adapter in RL_ADAPTERS else self.plan.seed + epoch
        config = TrainConfig(
            base_model=self.plan.base_model, output_dir=str(folder / "train"), version=f"policy-e{epoch:03d}",
            init_adapter=previous.uri if previous else None, seed=seed,
            export_gguf=self.plan.serve_dtype if stage.apply == "merged" else "none",
            args=trainer_args(self.plan, stage.optimize), run_dir=str(self.output),
        )
        bar = PhaseBar(epoch, "optimize", self.progress)
        try:
            artefact = self.train(adapter, folder / "curated.jsonl", config, bar.tick)
        except (TrainingFailed, ValueError) as exc:
            bar.done(error="failed")
            raise TrainError(f"epoch {epoch} ({stage.name}) optimize with {adapter}: {exc}") from None
        loss = artefact.metrics.get("train_loss", artefact.metrics.get("loss", math.nan))  # TRL's name, grpo's
        bar.done(loss=f"{loss:.4f}", steps=int(artefact.metrics.get("steps", 0)))
        return artefact

    def _remember_best(self, summary: dict[str, Any], artefact: Artefact | None) -> None:
        reward = summary.get("mean_reward")
        best = self.state.get("best")
        if reward is not None and (best is None or reward > best["reward"]):
            self.state["best"] = {"reward": reward, "artefact": artefact.model_dump() if artefact else None,
                                  "version": self.serving.version}

    def _guard(self, summary: dict[str, Any], artefact: Artefact, mode: str) -> dict[str, Any] | None:
        """Keep the epoch's model when its validation is within `max_drop` of the best and meets every
        `accept` threshold; else serve the best model again (and stop, with on_violation: stop)."""
        guard = self.plan.guard
        reward = summary.get("mean_reward")
        best = self.state.get("best")
        problems = [] if guard is None else guard_problems(summary, best, guard.max_drop, guard.accept)
        if guard is None or reward is None or not problems:
            self._remember_best(summary, artefact)
            self._save_state()
            return None if guard is None else {"ok": True}
        restored = Artefact.model_validate(best["artefact"]) if best and best["artefact"] else None
        self.serving.apply(restored, mode)
        self.state["applied"] = best["artefact"] if best else None
        self.state["last"] = self.state["applied"]  # the next epoch trains on from the restored weights
        verdict = {"ok": False, "reward": reward, "best": best["reward"] if best else None,
                   "restored": self.serving.version, "action": guard.on_violation}
        if guard.accept:
            verdict["problems"] = problems
        if guard.on_violation == "stop":
            self.state["stopped"] = f"{'; '.join(problems)}; restored {self.serving.version}"
        self._save_state()
        self.log(f"guard: {'; '.join(problems)}: restored {self.serving.version}")
        return verdict

    def prune(self) -> None:
        """Delete what no resume or guard can need: merged GGUFs that are neither applied, last nor the
        best (each is hundreds of MB), and with `checkpoints.keep_last: N` the weights and trainer state
        of steps older than the last N (their artefact.json stays: a finished step is never redone),
        except every `checkpoints.every`-th step's, kept to rewind to."""
        kept: set[str] = set()
        best = (self.state.get("best") or {}).get("artefact")
        for artefact in (self.state.get("applied"), self.state.get("last"), best):
            for uri in (artefact or {}).get("uri"), (artefact or {}).get("serving_uri"):
                if uri:
                    kept.add(str(Path(uri).resolve()))
        every = self.plan.checkpoints.every

        def rewindable(train: Path) -> bool:  # every Nth step's weights stay, to rewind to
            number = train.parent.name.rpartition("-")[2]
            return bool(every) and number.isdigit() and int(number) % every == 0

        for path in self.output.glob("*-*/train/policy-*.gguf"):
            if str(path.resolve()) not in kept and not rewindable(path.parent):
                path.unlink(missing_ok=True)
        keep_last = self.plan.checkpoints.keep_last
        if not keep_last:
            return
        finished = sorted(train for train in self.output.glob("*-*/train") if (train / ARTEFACT_FILE).is_file())
        for train in finished[:-keep_last]:
            if rewindable(train) or any(uri.startswith(str(train.resolve()) + os.sep) for uri in kept):
                continue
            for name in ("checkpoint", "adapter"):
                shutil.rmtree(train / name, ignore_errors=True)
            for path in train.glob("*.gguf"):
                path.unlink(missing_ok=True)


def guard_problems(summary: dict[str, Any], best: dict[str, Any] | None, max_drop: float | None,
                   accept: dict[str, float]) -> list[str]:
    """Why a validated model may not stay: its reward fell more than max_drop below the best, or a
    metric is below its acceptance threshold (a missing metric counts as below)."""
    problems = []
    reward = summary.get("mean_reward")
    if max_drop is not None and best is not None and reward is not None and reward + 1e-12 < best["reward"] - max_drop:
        problems.append(f"validation reward {reward:.3f} fell more than {max_drop} below the best {best['reward']:.3f}")
    for metric, least in accept.items():
        value = summary.get(metric)
        if value is None or value + 1e-12 < least:
            shown = "missing" if value is None else f"{value:.3f}"
            problems.append(f"validation {metric} {shown} is below the accepted {least}")
    return problems


def run_plan(plan: Plan, *, progress: bool = True) -> dict[str, Any]:
    return TrainLoop(plan, progress=progress).run()


__all__ = ["PHASES", "TrainError", "TrainLoop", "guard_problems", "read_json", "read_rollouts", "run_plan",
           "write_json"]
