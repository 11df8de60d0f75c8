"""A training step in a child process, so that a crash or an out-of-memory kill fails that step with
its cause instead of taking the training loop down with it.

    job = SubprocessJob.start("trl_sft", Path("curated.jsonl"), config)
    artefact = job.wait()          # TrainingFailed("... Traceback's last line ...") if it crashed

The child is this module too, `python -m rollgym.train.trainers.jobs SPEC` (`run_spec`: the trainer's
import path, the dataset, the config); its output goes to `train.log` in the step's folder, and it writes
`artefact.json` there atomically as its last act, so a step whose `artefact.json` exists is finished
(the loop does not redo it) and a crashed one leaves none.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson

from ...data.jsonl import write_atomic
from ...processes import die_with_parent
from .base import Artefact, JobStatus, TrainConfig, TrainingFailed, import_path, load_trainer

ARTEFACT_FILE = "artefact.json"
LOG_FILE = "train.log"
SPEC_FILE = "job.json"


def finished_artefact(output_dir: Path) -> Artefact | None:
    """The artefact a finished step left in its folder, or None."""
    path = output_dir / ARTEFACT_FILE
    if not path.is_file():
        return None
    return Artefact.model_validate_json(path.read_bytes())


def log_cause(log: Path, lines: int = 12) -> str:
    """The end of a failed run's log: the exception line, and what led to it."""
    if not log.is_file():
        return "(no log)"
    text = log.read_text(errors="replace").strip().splitlines()
    # The last line of a traceback names the exception; keep a little context before it.
    return "\n".join(text[-lines:]) if text else "(empty log)"


def own_group_dies_with_parent() -> None:
    # In the child before exec: its own process group (so cancel() reaches the trainer's helpers too),
    # and SIGKILL from the kernel if the loop dies, so a killed run leaves no trainer behind.
    os.setsid()
    die_with_parent(signal.SIGKILL)


class SubprocessJob:
    """A `TrainingJob` whose trainer runs `fit` in a child Python process."""

    def __init__(self, process: subprocess.Popen[bytes], output_dir: Path, trainer: str) -> None:
        self.process = process
        self.output_dir = output_dir
        self.trainer = trainer
        self._cancelled = False

    @classmethod
    def start(cls, trainer: str, dataset: Path, config: TrainConfig, *, python: str | None = None,
              env: dict[str, str] | None = None) -> "SubprocessJob":
        output_dir = Path(config.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / ARTEFACT_FILE).unlink(missing_ok=True)
        spec = {"trainer": import_path(trainer), "dataset": str(Path(dataset).resolve()), "config": config.model_dump()}
        (output_dir / SPEC_FILE).write_bytes(orjson.dumps(spec, option=orjson.OPT_INDENT_2))
        with (output_dir / LOG_FILE).open("ab") as log:
            process = subprocess.Popen(
                [python or sys.executable, "-m", "rollgym.train.trainers.jobs", str(output_dir / SPEC_FILE)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, preexec_fn=own_group_dies_with_parent,
            )
        return cls(process, output_dir, trainer)

    def status(self) -> JobStatus:
        code = self.process.poll()
        if code is None:
            return "running"
        if self._cancelled:
            return "cancelled"
        return "succeeded" if code == 0 and (self.output_dir / ARTEFACT_FILE).is_file() else "failed"

    def wait(self, timeout: float | None = None) -> Artefact:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TrainingFailed(f"{self.trainer}: still running after {timeout} s") from None
        if self._cancelled:
            raise TrainingFailed(f"{self.trainer}: cancelled")
        log = self.output_dir / LOG_FILE
        if code < 0:
            name = signal.Signals(-code).name
            hint = " (the kernel's out-of-memory killer sends SIGKILL)" if code == -signal.SIGKILL else ""
            raise TrainingFailed(f"{self.trainer}: the training process was killed by {name}{hint}; "
                                 f"end of {log}:\n{log_cause(log)}")
        artefact = finished_artefact(self.output_dir)
        if code != 0 or artefact is None:
            raise TrainingFailed(f"{self.trainer}: the training process exited with status {code}; "
                                 f"end of {log}:\n{log_cause(log)}")
        return artefact

    def cancel(self) -> None:
        if self.process.poll() is None:
            self._cancelled = True
            os.killpg(self.process.pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while self.process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


def run_spec(spec_file: Path) -> None:
    """The child's work: load the trainer the spec names, `fit` it on the dataset, and write the
    artefact to `artefact.json` (atomically, last), so the parent can tell a finished step from a crashed one."""
    spec = orjson.loads(spec_file.read_bytes())
    config = TrainConfig.model_validate(spec["config"])
    artefact = load_trainer(spec["trainer"]).fit(Path(spec["dataset"]), config)
    write_atomic(Path(config.output_dir) / ARTEFACT_FILE, artefact.model_dump_json(indent=2))
    print(f"artefact: {artefact.model_dump_json()}", flush=True)


__all__ = ["ARTEFACT_FILE", "LOG_FILE", "SubprocessJob", "finished_artefact", "log_cause", "own_group_dies_with_parent",
           "run_spec"]


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: python -m rollgym.train.trainers.jobs JOB.json", file=sys.stderr)
        sys.exit(2)
    run_spec(Path(sys.argv[1]))

