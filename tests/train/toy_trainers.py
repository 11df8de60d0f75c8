"""Trainer adapters for the tests of jobs and the loop: real adapters (they run in a child process
through SubprocessJob, read the curated data and write an artefact) that train nothing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson

from rollgym.train.trainers import Artefact, TrainConfig


class CountingTrainer:
    """Writes a PEFT-shaped folder; counts its calls in `calls.log` next to the run's epochs."""

    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        rows = [orjson.loads(line) for line in dataset.read_bytes().splitlines() if line.strip()]
        out = Path(config.output_dir)
        (out / "adapter").mkdir(parents=True, exist_ok=True)
        (out / "adapter" / "adapter_config.json").write_text("{}")
        with (out.parents[1] / "calls.log").open("a") as log:
            log.write(f"{config.version} {len(rows)} {config.init_adapter}\n")
        time.sleep(float(config.args.get("sleep_s", 0)))
        return Artefact(kind="lora", uri=str(out / "adapter"), base_model=config.base_model, version=config.version,
                        metrics={"examples": float(len(rows)), "train_loss": 0.5, "train_s": 0.0})


class CrashingTrainer:
    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        raise MemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (toy)")


class KilledTrainer:
    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        os.kill(os.getpid(), signal.SIGKILL)  # what the kernel's out-of-memory killer does
        raise AssertionError("unreachable")


class SleepingTrainer:
    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        Path(config.output_dir, "started").write_text(str(os.getpid()))
        time.sleep(120)
        raise AssertionError("should have been cancelled")


class NotATrainer:
    pass
