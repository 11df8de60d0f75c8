"""Training steps in a child process: an artefact comes back, a crash or a kill fails the step with
its cause, a job can be cancelled, and the loop's adapter names resolve or are refused clearly."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rollgym.testing import REPO_ROOT
from rollgym.train.trainers.jobs import SubprocessJob
from rollgym.train.trainers.base import BUILTIN, TrainConfig, TrainingFailed, load_trainer

TOY = "tests.train.toy_trainers"
ENV = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def start(tmp_path: Path, adapter: str) -> SubprocessJob:
    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"x": 1}\n{"x": 2}\n')
    config = TrainConfig(base_model="bundled", output_dir=str(tmp_path / "epoch-001" / "train"), version="v1")
    return SubprocessJob.start(adapter, dataset, config, env=ENV)


def test_a_finished_job_returns_its_artefact(tmp_path: Path) -> None:
    job = start(tmp_path, f"{TOY}:CountingTrainer")
    artefact = job.wait(60)
    assert job.status() == "succeeded"
    assert artefact.version == "v1" and artefact.metrics["examples"] == 2.0
    assert Path(artefact.uri, "adapter_config.json").is_file()
    assert (tmp_path / "epoch-001" / "train" / "artefact.json").is_file()


def test_a_crash_fails_the_step_with_its_cause(tmp_path: Path) -> None:
    job = start(tmp_path, f"{TOY}:CrashingTrainer")
    with pytest.raises(TrainingFailed, match=r"exited with status 1(.|\n)*MemoryError: CUDA out of memory"):
        job.wait(60)
    assert job.status() == "failed"


def test_a_killed_trainer_is_reported_as_such(tmp_path: Path) -> None:
    job = start(tmp_path, f"{TOY}:KilledTrainer")
    with pytest.raises(TrainingFailed, match=r"killed by SIGKILL \(the kernel's out-of-memory killer"):
        job.wait(60)


def test_cancel_stops_the_trainer(tmp_path: Path) -> None:
    job = start(tmp_path, f"{TOY}:SleepingTrainer")
    marker = tmp_path / "epoch-001" / "train" / "started"
    deadline = time.monotonic() + 60
    while not marker.is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.status() == "running"
    job.cancel()
    assert job.status() == "cancelled"
    with pytest.raises(TrainingFailed, match="cancelled"):
        job.wait(5)


def test_trainer_names(tmp_path: Path) -> None:
    assert set(BUILTIN) == {"trl_sft", "trl_dpo", "grpo", "trl_grpo"}
    assert BUILTIN["trl_grpo"] == BUILTIN["grpo"]  # TRL's GRPOTrainer cannot take the sampling logprobs
    with pytest.raises(ValueError, match="unknown trainer 'sft'"):
        load_trainer("sft")
    with pytest.raises(ValueError, match="cannot import 'no_such_module:X'"):
        load_trainer("no_such_module:X")
    with pytest.raises(ValueError, match=r"neither fit\(dataset, config\) nor submit"):
        load_trainer(f"{TOY}:NotATrainer")
    job = start(tmp_path, "no_such_module:X")  # the child reports it: the step fails, not the loop
    with pytest.raises(TrainingFailed, match="cannot import 'no_such_module:X'"):
        job.wait(60)
