"""`checkpoint_every: 2` in the long-lived trainer process, full weights sharded over 2 gloo processes: the
steps between checkpoints leave only a note (full weights are served from memory), every second step a
sharded checkpoint written in the background, and the stop checkpoints the last step. A new process resumed
from the background checkpoint takes exactly the step the first one took; a step between checkpoints is
refused as a starting point, by name."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors.torch")

from rollgym.train.trainers.base import TrainConfig, TrainingFailed  # noqa: E402
from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_process import LongLivedTrainer  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer  # noqa: E402

from .test_grpo_trainer import groups  # noqa: E402

ARGS = {"learning_rate": 1e-2, "finetune": "full", "processes": 2, "threads": 1, "checkpoint_every": 2}


def weights(checkpoint: Path) -> dict:
    return safetensors.load_file(checkpoint / "model" / "model.safetensors")


def placed(checkpoint: Path, timeout: float = 60.0) -> bool:
    """Whether the background checkpoint is in place (its folder renamed in once every part was written)."""
    deadline = time.monotonic() + timeout
    while not (checkpoint / "trainer_state.pt").is_file():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_checkpoints_every_second_step_in_the_background_and_at_the_stop(tiny_model, tmp_path) -> None:
    data = tmp_path / "groups.jsonl"
    data.write_bytes(b"".join(orjson.dumps(g) + b"\n" for g in groups(7)))

    def config(run: Path, step: int, init: str | None) -> TrainConfig:
        return TrainConfig(base_model=tiny_model, output_dir=str(run / f"step-{step}" / "train"), version=f"s{step}",
                           init_adapter=init, run_dir=str(run), args=ARGS)

    first, run = LongLivedTrainer(), tmp_path / "run"
    try:
        artefacts = [None]
        for step in (1, 2, 3):
            artefacts.append(first.submit(data, config(run, step, artefacts[-1] and artefacts[-1].uri)).wait(120))
        pid = first.process.pid
    finally:
        first.close()
    checkpoints = [run / f"step-{step}" / "train" / "checkpoint" for step in (1, 2, 3)]
    # Step 1: no weights, no optimizer state, only the note; step 2: the checkpoint, written in the background.
    assert sorted(p.name for p in checkpoints[0].iterdir()) == ["serving_only.json"]
    assert placed(checkpoints[1]) and len(list((checkpoints[1] / "optimizer").glob("*.distcp"))) == 2
    # Step 3 was between checkpoints; the stop checkpointed it.
    assert sorted(p.name for p in checkpoints[2].iterdir()) == ["model", "optimizer", "trainer_state.pt"]
    assert [a.metrics["optimizer_step"] for a in artefacts[1:]] == [1.0, 2.0, 3.0]

    # A new process from step 2's checkpoint takes step 3 exactly as the first one did.
    second, again = LongLivedTrainer(), tmp_path / "again"
    try:
        resumed = second.submit(data, config(again, 3, artefacts[2].uri)).wait(120)
        assert second.process.pid != pid and resumed.metrics["load_s"] > 0
    finally:
        second.close()
    assert resumed.metrics["loss"] == artefacts[3].metrics["loss"] and resumed.metrics["optimizer_step"] == 3.0
    went_on, took_again = weights(checkpoints[2]), weights(again / "step-3" / "train" / "checkpoint")
    assert went_on.keys() == took_again.keys() and all(torch.equal(went_on[k], took_again[k]) for k in went_on)

    # A step between checkpoints holds no optimizer state: refused as a starting point, by name.
    with pytest.raises(TrainingFailed, match=r"step-1/train/checkpoint is a step between checkpoints "
                                             r"\(checkpoint_every 2\).*trainer_state\.pt"):
        PolicyTrainer(GRPOConfig(**ARGS), tiny_model).load(artefacts[1].uri)
