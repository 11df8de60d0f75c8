"""`rollgym train` with `mode: async`: the orchestrator streams step batches while the trainer steps.

    OUTPUT/plan.json                 the validated plan
    OUTPUT/history.jsonl             step 0: the base model's validation; then one line per trained step:
                                     the orchestrator's step metrics, the trainer's, the validation's
    OUTPUT/reward.png, steps.png     rewards per step; staleness, waits and dropped groups per step
    OUTPUT/orchestrator/             the orchestrator's history.jsonl, failures.jsonl, and steps/ (every
                                     batch as a step folder, with the adapter its step finished with)
    OUTPUT/step-NNN/                 curated.jsonl (the batch as training records), train/ (adapter, log),
                                     validation.jsonl

Each batch (whole groups from `orchestrator`) is curated to what the plan's `optimize` trainer trains
on (GRPO groups for `grpo`) and trained on by it, starting from the previous step's LoRA; its adapter is
then hot-loaded on the stack's model servers (the orchestrator's `finish_step`) before generation for
later steps goes on. With `colocate: true` the step runs inside the policy server and is served as soon
as it returns (published in memory, LoRA or full weights): `finish_step` only reads its version back. Meanwhile the orchestrator keeps generating up to `max_async_level` steps ahead. With a
`teacher` (on-policy distillation, teacher.py), every batch's curated tokens are scored before its step.

**Resuming.** The orchestrator keeps every batch as a step folder (`OUTPUT/orchestrator/steps/`), and a
step counts as finished once its line is in `history.jsonl`. The same command run again on the same
output continues after the last finished step: batches already handed out come again unchanged (none
is generated twice, none is lost), a step whose trainer had finished (`train/artefact.json`) is not
trained again, the last finished step's adapter is loaded again before anything generates, and a
validation cut short is done again whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import orjson

from ..orchestrator.orchestrator import Orchestrator, OrchestratorError
from ..orchestrator.transports.folders import Batch
from ..trainers.base import Artefact, TrainingFailed
from ..trainers.jobs import finished_artefact
from ..trainers.progress import describe
from .curation import CurateConfig, Curated, CurationError, curate
from .epochs import TrainLoop
from .errors import TrainError
from .optimize import step_config
from .teacher import TeacherError, score_records_async


class AsyncTrainLoop(TrainLoop):
    """The plan's `orchestrator` and `optimize` sections, run as one asynchronous RL loop."""

    unit = "step"

    def run(self) -> dict[str, Any]:
        plan = self.plan
        assert plan.orchestrator is not None and plan.optimize is not None
        new, existed = not self.folder.holds_run(), self.output.exists()
        finished = self._open_output()
        self.state = self.folder.read_state()
        if self.state.get("stopped"):
            self.log(f"this run has stopped already: {self.state['stopped']}")
            return self.state
        self._start_serving("memory" if plan.colocate else "weights" if self._full() else "lora", new, existed)
        try:
            if plan.validation is not None and not any(line.get("step") == 0 for line in self.history()):
                summary = self.validation.validate(0, self._step_dir(0))
                self.guard.remember_best(self.state, summary, None, self.serving.version)
                self._finish({"epoch": 0, "step": 0, "stage": "async", "model_version": None, "validation": summary})
            try:
                orchestrator = Orchestrator(plan.orchestrator, self.serving.registry, self.output / "orchestrator",
                                            log=self.log, loader=self._loader())
            except ValueError as exc:  # e.g. a tasks file gone since the plan was loaded
                raise TrainError(f"orchestrator: {exc}") from None
            if finished:
                self.log(f"resuming after step {finished}")
            try:
                asyncio.run(self._steps(orchestrator, finished))
            except OrchestratorError as exc:
                raise TrainError(f"orchestrator: {exc}") from None
        finally:
            self.release()
            self.serving.stop()
        return self.state

    def _full(self) -> bool:
        """Full weights on engines that reload them (apply: weights), rather than a LoRA hot-load."""
        return not self.plan.colocate and self.plan.optimize is not None and self.plan.optimize.finetune == "full"

    def _loader(self) -> Any:
        """Co-locate mode: each step is served once it returns (published in memory), under its version. Full
        weights: every replica reloads each step's checkpoint (apply: weights)."""
        if self._full():
            return self._reload_loader()
        if not self.plan.colocate:
            return None
        from .colocate import memory_loader

        assert self.plan.optimize is not None
        return memory_loader(self.serving.registry, self.plan.optimize.finetune == "full", step_version)

    def _reload_loader(self) -> Any:
        """The orchestrator's `loader` for full weights: stage, check and reload the step's checkpoint on every
        replica (weights.py); the version then maps to the step, whether or not every replica took it (those
        that failed go on answering with their old version, which maps to its own step)."""
        from ..orchestrator.policy_versions import AdapterLoadError
        from .apply import POLICY
        from .weights import WeightsRefused

        serving = self.serving
        assert serving.full is not None and self.plan.orchestrator is not None
        # In-flight updates: running generations are aborted, and the policy server continues them on the new
        # weights (models/chat_completions continue_aborted); else they finish on the old ones first.
        pause_mode = "abort" if self.plan.orchestrator.inflight_updates else "wait"

        async def load(uri: str, step: int) -> list[str]:
            version = serving.full_version(step_version(step))
            try:
                sync = await serving.full.publish_async(serving.registry, POLICY, uri, version, pause_mode)
            except WeightsRefused as exc:
                raise AdapterLoadError(f"step {step}: {exc}") from None
            return [version] if any(replica["ok"] for replica in sync.replicas) else []

        return load

    def _open_output(self) -> int:
        """Start a run in an empty output folder, or find where a run of the same plan stopped: the
        number of steps it finished (each has its line in history.jsonl)."""
        if self.folder.holds_other_files():
            raise TrainError(f"{self.output} is not empty and holds no run (no plan.json); use another output folder")
        self._claim_output()
        steps = sorted(int(line["step"]) for line in self.history() if int(line.get("step", 0)) > 0)
        if steps != list(range(1, len(steps) + 1)):
            raise TrainError(f"{self.history_path}: finished steps {steps} are not 1..N; cannot resume")
        return len(steps)

    def _step_dir(self, step: int) -> Path:
        folder = self.folder.unit_dir(step)
        folder.mkdir(exist_ok=True)
        # Validation rollouts of a killed run came from a model version this run does not serve.
        for stale in folder.glob("validation*.jsonl"):
            stale.unlink()
        return folder

    def _trained_before(self, finished: int) -> Artefact | None:
        """The adapter the last finished steps trained (the next step trains on from it)."""
        for step in range(finished, 0, -1):
            artefact = finished_artefact(self.folder.unit_dir(step) / "train")
            if artefact is not None:
                return artefact
        return None

    async def _steps(self, orchestrator: Orchestrator, finished: int) -> None:
        previous = self._trained_before(finished)
        async with contextlib.aclosing(orchestrator.batches(persist=True, finished=finished)) as batches:
            async for batch in batches:
                previous = await self._step(orchestrator, batch, previous)
                if self.state.get("stopped"):
                    self.log(f"stopped: {self.state['stopped']}")
                    return

    async def _step(self, orchestrator: Orchestrator, batch: Batch, previous: Artefact | None) -> Artefact | None:
        """Train on one batch, serve the result, validate and guard it; the adapter the next step trains from."""
        folder = self._step_dir(batch.step)
        line: dict[str, Any] = {"epoch": batch.step, "step": batch.step, "stage": "async",
                                "orchestrator": batch.metrics,
                                "train": {"mean_reward": batch.metrics["reward_mean"],
                                          "rollouts": batch.metrics["rollouts"]}}
        curated = self._curate(batch.rollouts, folder)
        line["curated"] = curated.summary()
        if self.plan.teacher is not None and curated.records:  # every trained token, scored by the teacher
            try:  # while the orchestrator goes on generating in this event loop
                line["curated"]["teacher"] = await score_records_async(curated.records, self.plan.teacher,
                                                                       self.serving.registry)
            except TeacherError as exc:
                raise TrainError(f"step {batch.step} curate: {exc}") from None
        with (folder / "curated.jsonl").open("wb") as handle:
            for record in curated.records:
                handle.write(orjson.dumps(record) + b"\n")
        if curated.records:
            started = time.perf_counter()
            artefact = finished_artefact(folder / "train")  # trained before a kill: not trained again
            if artefact is None:
                artefact = await asyncio.to_thread(self._train_step, batch.step, folder, previous)
            line["train"].update(artefact.metrics, optimize_s=round(time.perf_counter() - started, 3))
            await orchestrator.finish_step(batch.step, artefact.uri)
            previous = artefact
            self.state["applied"] = self.state["last"] = artefact.model_dump()
        else:  # e.g. no group with a reward spread for GRPO: nothing to learn, the served weights stay
            await orchestrator.finish_step(batch.step, None)
            line["train"]["skipped"] = "nothing to train on after curation"
        line["model_version"] = self.serving.version = orchestrator.served_version()
        if self.serving.full is not None and self.serving.full.last is not None and curated.records:
            line["weights"] = self.serving.full.last.summary()
        line["artefact"] = previous.uri if previous else None
        if self.validation.due(batch.step):
            line["validation"] = await asyncio.to_thread(self.validation.validate, batch.step, folder)
            # Generation already runs ahead on these weights: the guard cannot roll back, only stop.
            line["guard"] = self.guard.check(self.state, line["validation"], previous, self.serving.version, None)
        self._save_state()
        self._finish(line)
        self.prune()
        return previous

    def _curate(self, rollouts: list[dict[str, Any]], folder: Path) -> Curated:
        """The batch as the optimize trainer's records (GRPO groups for grpo), every segment of a rollout
        with its rollout's advantage (the plan's `curate.segments`)."""
        plan = self.plan
        assert plan.orchestrator is not None and plan.optimize is not None
        segments = plan.curate.segments if plan.curate is not None else "all"
        try:
            # The batch's advantages are the orchestrator's (its `advantage` setting): kept, never recomputed.
            curated = curate(rollouts, plan.optimize.data or "groups", CurateConfig(segments=segments),
                             group_size=plan.orchestrator.rollouts_per_example, stage=folder.name,
                             keep_advantages=True)
        except CurationError as exc:
            raise TrainError(str(exc)) from None
        return curated

    def _train_step(self, step: int, folder: Path, previous: Artefact | None) -> Artefact:
        optimize = self.plan.optimize
        assert optimize is not None
        config = step_config(self.plan, optimize, folder, step_version(step), step, previous)
        shown: list[Any] = [0]

        def tick(progress: dict[str, Any] | None) -> None:  # a line per optimizer step (trainers/progress.py)
            if self.progress and progress is not None and progress["step"] != shown[0]:
                shown[0] = progress["step"]
                self.log(f"step {step} optimize: {describe(progress)}")

        try:
            return self.trainers.train(optimize.trainer, folder / "curated.jsonl", config, tick)
        except (TrainingFailed, ValueError) as exc:
            raise TrainError(f"step {step} optimize with {optimize.trainer}: {exc}") from None


def step_version(step: int) -> str:
    """The version of the weights step `step` trains (co-located: what the server lists after the step)."""
    return f"policy-s{step:03d}"


__all__ = ["AsyncTrainLoop", "step_version"]
