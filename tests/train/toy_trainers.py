"""Trainer adapters for the tests of jobs and the loop: real adapters (they run in a child process
through SubprocessJob, read the curated data and write an artefact) that train nothing."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import orjson

from rollgym.train.trainers.base import Artefact, TrainConfig


class CountingTrainer:
    """Writes a PEFT-shaped folder; counts its calls in `calls.log` next to the run's epochs."""

    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        rows = [orjson.loads(line) for line in dataset.read_bytes().splitlines() if line.strip()]
        out = Path(config.output_dir)
        (out / "adapter").mkdir(parents=True, exist_ok=True)
        # Each step's files differ, as a real trainer's do: the served version is a digest of them.
        (out / "adapter" / "adapter_config.json").write_text(orjson.dumps({"trained_as": config.version}).decode())
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


class GgufTrainer:
    """For apply: merged. Epoch 1 serves the base weights again under its own name; epoch 2 serves
    weights with loud noise added (a step that broke the model)."""

    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        import numpy as np

        from rollgym.train.trainers.gguf_export import write_merged_gguf
        from rollgym.train.trainers.policy import bundled_gguf

        out = Path(config.output_dir)
        (out / "adapter").mkdir(parents=True, exist_ok=True)
        serving = out / f"{config.version}.gguf"
        if config.version.endswith("1"):
            os.link(out.parents[1] / "serving" / "policy-base.gguf", serving)
        else:
            noise = np.random.default_rng(0)
            deltas = {f"model.layers.{i}.mlp.down_proj": noise.normal(0, 1.0, (576, 1536)).astype(np.float32)
                      for i in range(30)}
            write_merged_gguf(bundled_gguf(), deltas, serving, "f16")
        return Artefact(kind="lora", uri=str(out / "adapter"), base_model=config.base_model, version=config.version,
                        serving_uri=str(serving), metrics={"train_s": 0.0})


class FullWeightsTrainer:
    """For apply: weights. Writes the step's checkpoint as the grpo trainer writes full weights
    (checkpoint/model/model.safetensors), the tensors of `args.reference` with every value moved by the step's
    number (`args.shapes`: other shapes, a checkpoint no engine could load)."""

    def fit(self, dataset: Path, config: TrainConfig) -> Artefact:
        import numpy as np
        from safetensors.numpy import load_file, save_file

        weights = load_file(str(Path(config.args["reference"]) / "model.safetensors"))
        for name, shape in (config.args.get("shapes") or {}).items():
            weights[name] = np.zeros(shape, dtype=np.float32)
        model = Path(config.output_dir) / "checkpoint" / "model"
        model.mkdir(parents=True, exist_ok=True)
        save_file({name: value + 0.01 for name, value in weights.items()}, str(model / "model.safetensors"))
        return Artefact(kind="full_weights", uri=str(model), base_model=config.base_model, version=config.version,
                        metrics={"train_loss": 0.5, "train_s": 0.0})
