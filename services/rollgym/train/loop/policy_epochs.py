"""One epoch of a plan with several policies: one collection, then each policy on its own.

The epoch collects once through the stack (every policy's calls served by its current adapter), then for each
policy in the plan's order: curate its view of the rollouts (policies.py: its segments, its reward, grouped
per task) into `epoch-NNN/POLICY/curated.jsonl`, optimise it with a trainer instance of its own (its own
process, model, optimizer and step counter; `OUTPUT/policies/POLICY/trainer/` for a long-lived one), and apply
the step's adapter under the policy's name. Each of those phases is recorded in the epoch's `phases.json`
under `POLICY/PHASE` as it finishes, so a killed run resumes inside the policy it stopped in, and the run's
state keeps each policy's applied, last and best artefacts (`state.json`'s `policies`), which a resumed run
serves again before it collects.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import orjson

from ...data.jsonl import read_whole_lines, write_json_atomic
from ..trainers.base import Artefact, TrainingFailed
from ..trainers.jobs import finished_artefact
from .curation import CurationError, curate
from .dynamic_sampling import epoch_files
from .errors import TrainError
from .optimize import step_config, trainer_args
from .plan import OptimizeConfig, StageConfig
from .policies import PolicyConfig, policy_rollouts, policy_summary
from .run_folder import read_json

# Curation drops that mean "nothing to learn" for a policy this epoch (its groups all alike), not an error.
NO_SIGNAL = frozenset({"below_min_reward", "zero_reward_spread", "low_reward_spread", "unpaired", "not_top_k",
                       "curriculum", "duplicate_prompt", "tool_error", "repetition", "gibberish", "not_this_policy"})


def policy_optimize(stage: StageConfig, policy: PolicyConfig) -> OptimizeConfig:
    """The stage's optimize section with the policy's own trainer arguments over its args."""
    if not policy.args:
        return stage.optimize
    return OptimizeConfig.model_validate({**stage.optimize.model_dump(exclude={"args"}),
                                          "args": {**stage.optimize.args, **policy.args}})


def policy_state(loop: Any, name: str) -> dict[str, Any]:
    return loop.state.setdefault("policies", {}).setdefault(name, {})


def policy_artefact(loop: Any, name: str, key: str) -> Artefact | None:
    data = loop.state.get("policies", {}).get(name, {}).get(key)
    return Artefact.model_validate(data) if data else None


def serve_applied(loop: Any) -> None:
    """A resumed run serves every policy's last applied adapter again before anything is generated."""
    for policy in loop.plan.policies:
        applied = policy_artefact(loop, policy.name, "applied")
        if applied is not None:
            loop.log(f"resuming: serving {applied.version} as policy {policy.name} again")
            loop.serving.apply_policy(policy.name, applied)


def run_epoch(loop: Any, epoch: int, stage: StageConfig) -> None:
    """Collect once, then curate, optimise and apply each policy; validate; the epoch's history line."""
    folder = loop.folder.unit_dir(epoch)
    folder.mkdir(parents=True, exist_ok=True)
    phases_path = folder / "phases.json"
    phases: dict[str, Any] = read_json(phases_path, {})
    started = time.perf_counter()

    def finish(name: str, result: dict[str, Any], seconds: float) -> None:
        phases[name] = {**result, "s": round(seconds, 3)}
        write_json_atomic(phases_path, phases)

    if "collect" not in phases:
        t = time.perf_counter()
        versions = dict(loop.serving.policy_versions)
        summary = loop.collections.collect(epoch, stage, folder, 0)
        finish("collect", {"model_versions": versions, "summary": summary}, time.perf_counter() - t)
    rollouts = [row for file in epoch_files(folder) for row in read_whole_lines(file)]
    lines: dict[str, Any] = {}
    for policy in loop.plan.policies:
        lines[policy.name] = _policy_step(loop, epoch, stage, policy, folder, rollouts, phases, finish)

    validation = None
    if loop.validation.due(epoch):
        if "validate" not in phases:
            t = time.perf_counter()
            finish("validate", {"summary": loop.validation.validate(epoch, folder)}, time.perf_counter() - t)
        validation = phases["validate"]["summary"]
        for name, figures in (validation.get("policies") or {}).items():
            lines[name]["validation"] = figures
            _remember_best(loop, name, figures)
        loop._save_state()
    collected = phases["collect"]["summary"]
    line = {
        "epoch": epoch, "stage": stage.name, "model_version": None,
        "model_versions": dict(loop.serving.policy_versions),
        "train": {"mean_reward": collected.get("mean_reward"),
                  **{k: v for k, v in collected.items() if k.startswith("pass@")},
                  "rollouts": collected.get("rollouts"), "failed": collected.get("failed")},
        "policies": lines, "validation": validation, "guard": None,
        "phases_s": {name: value["s"] for name, value in phases.items()},
        "wall_s_this_run": round(time.perf_counter() - started, 3),
    }
    loop._finish(line)


def _policy_step(loop: Any, epoch: int, stage: StageConfig, policy: PolicyConfig, folder: Path,
                 rollouts: list[dict[str, Any]], phases: dict[str, Any], finish: Any) -> dict[str, Any]:
    """Curate, optimise and apply one policy; its part of the epoch's history line."""
    name = policy.name
    place = folder / name
    place.mkdir(parents=True, exist_ok=True)
    where = f"epoch {epoch} ({stage.name}) policy {name}"
    version = phases["collect"]["model_versions"].get(name)
    views, left = policy_rollouts(rollouts, policy, loop.plan.credit)
    if f"{name}/curate" not in phases:
        t = time.perf_counter()
        kind = stage.optimize.data or "sft"
        try:
            curated = curate(views, kind, stage.curate, epoch=epoch - 1, version=version,
                             group_size=stage.collect.repeats if stage.collect else None, stage=where)
        except CurationError as exc:
            raise TrainError(str(exc)) from None
        dropped = curated.summary()["dropped"]
        if not curated.records and not set(dropped) <= NO_SIGNAL:
            raise TrainError(f"{where}: nothing left to train on after curation ({dropped})")
        with (place / "curated.jsonl").open("wb") as handle:
            for record in curated.records:
                handle.write(orjson.dumps(record) + b"\n")
        result = curated.summary() | {"not_this_policy": left.get("not_this_policy", 0)}
        if not curated.records:
            result["skipped"] = f"nothing to learn from: {dropped}"
            loop.log(f"{where}: no training step: {result['skipped']}; the policy's adapter stays")
        finish(f"{name}/curate", result, time.perf_counter() - t)
    curated_phase = phases[f"{name}/curate"]
    own = policy_summary(rollouts, [policy], loop.plan.credit)[name]
    line: dict[str, Any] = {"train": own, "curated": {k: v for k, v in curated_phase.items() if k != "s"}}
    if curated_phase.get("skipped"):
        line["skipped"] = curated_phase["skipped"]
        line["model_version"] = loop.serving.policy_versions.get(name)
        return line

    artefact = finished_artefact(place / "train")  # a step that finished is never redone
    if artefact is None:
        t = time.perf_counter()
        artefact = _optimize(loop, epoch, stage, policy, place)
        finish(f"{name}/optimize", {"artefact": artefact.model_dump()}, time.perf_counter() - t)
    elif f"{name}/optimize" not in phases:
        finish(f"{name}/optimize", {"artefact": artefact.model_dump()}, 0.0)
    state = policy_state(loop, name)
    state["last"] = artefact.model_dump()
    state["steps"] = int(state.get("steps", 0)) + (0 if state.get("last_epoch") == epoch else 1)
    state["last_epoch"] = epoch
    loop._save_state()
    if f"{name}/apply" not in phases:
        seconds = 0.0
        if stage.apply != "none":
            seconds = loop.serving.apply_policy(name, artefact)
            state["applied"] = artefact.model_dump()
            loop._save_state()
        finish(f"{name}/apply", {"model_version": loop.serving.policy_versions.get(name)}, seconds)
    line.update(model_version=loop.serving.policy_versions.get(name), artefact=artefact.uri, step=state["steps"],
                trainer={k: v for k, v in artefact.metrics.items() if isinstance(v, (int, float))})
    return line


def _optimize(loop: Any, epoch: int, stage: StageConfig, policy: PolicyConfig, place: Path) -> Artefact:
    """One step of the policy's own trainer, continued from its own applied adapter."""
    optimize = policy_optimize(stage, policy)
    previous = policy_artefact(loop, policy.name, "applied" if stage.apply != "none" else "last")
    config = step_config(loop.plan, stage.optimize, place, f"{policy.name}-e{epoch:03d}", epoch, previous)
    args: Any = trainer_args(loop.plan, stage.optimize)
    if optimize is not stage.optimize:  # the policy's own arguments, the plan's schedule length kept
        own = optimize.grpo if optimize.grpo is not None else dict(optimize.args)
        if optimize.grpo is not None and not own.total_steps and getattr(args, "total_steps", None):
            own = own.model_copy(update={"total_steps": args.total_steps})
        args = own
    # Each policy's long-lived trainer keeps its process and checkpoints in a folder of its own.
    run_dir = Path(loop.plan.output) / "policies" / policy.name
    run_dir.mkdir(parents=True, exist_ok=True)
    config = config.model_copy(update={"args": args, "run_dir": str(run_dir)})
    trainer = stage.optimize.trainer
    try:
        artefact = loop.trainers.train(trainer, place / "curated.jsonl", config, None, key=f"{trainer}/{policy.name}")
    except (TrainingFailed, ValueError) as exc:
        raise TrainError(f"epoch {epoch} ({stage.name}) policy {policy.name} optimize with {trainer}: {exc}") from None
    loss = artefact.metrics.get("train_loss", artefact.metrics.get("loss", math.nan))
    loop.log(f"epoch {epoch} policy {policy.name}: step done, loss {loss:.4f}")
    return artefact


def _remember_best(loop: Any, name: str, figures: dict[str, Any]) -> None:
    """Each policy's best validation figure and the artefact that served it (its own metric)."""
    state = policy_state(loop, name)
    reward = figures.get("mean_reward")
    if reward is not None and (state.get("best_reward") is None or reward > state["best_reward"]):
        state["best_reward"] = reward
        state["best"] = state.get("applied")


def zero_line(loop: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """Epoch 0's per-policy part: each policy's validation of the base weights."""
    for name, figures in (summary.get("policies") or {}).items():
        _remember_best(loop, name, figures)
    return {name: {"model_version": loop.serving.policy_versions.get(name), "validation": figures}
            for name, figures in (summary.get("policies") or {}).items()}


__all__ = ["policy_optimize", "run_epoch", "serve_applied", "zero_line"]
