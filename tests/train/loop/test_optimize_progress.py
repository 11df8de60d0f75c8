"""The optimize line shows a trainer's steps while it runs: a real TRL SFT step (the bundled SmolLM2-135M, a
LoRA on its top layers, three optimizer steps) in its child process reports each step to the step's progress
file, and the loop's phase line, fed what the loop reads while it waits, prints `step k/3, N tokens/s, loss L`."""

from __future__ import annotations

import importlib.util
import io
import os
from pathlib import Path
from typing import Any

import orjson
import pytest

pytestmark = pytest.mark.slow

MISSING = next((m for m in ("torch", "trl", "peft", "gguf", "datasets") if importlib.util.find_spec(m) is None), None)
if MISSING:
    pytest.skip(f"{MISSING} is not installed (pip install -e '.[train,llamacpp]')", allow_module_level=True)

from rollgym.testing import REPO_ROOT  # noqa: E402
from rollgym.train.loop import epochs  # noqa: E402
from rollgym.train.loop.optimize import Trainers  # noqa: E402
from rollgym.train.trainers.base import TrainConfig  # noqa: E402
from rollgym.train.trainers.progress import read_progress  # noqa: E402


def records(path: Path) -> Path:
    rows = [{"rollout_id": f"r{i}", "prompt_ids": [1, 9690, 198, 28120 + i, 2], "completion_ids": [1097 + i, 314, 2],
             "completion_mask": [1, 1, 1]} for i in range(3)]
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return path


def test_a_real_sft_step_reports_each_step_through_the_optimize_line(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT / "services"), str(REPO_ROOT),
                                                                   os.environ.get("PYTHONPATH")])))
    shown = io.StringIO()
    monkeypatch.setattr(epochs.sys, "stderr", shown)  # the phase line's stream: a log file, not a terminal
    bar = epochs.PhaseBar(1, "optimize", True)
    bar.bar.fp = shown
    seen: list[dict[str, Any]] = []

    def tick(progress: dict[str, Any] | None) -> None:
        if progress is not None:
            seen.append(progress)
        bar.tick(progress)

    config = TrainConfig(base_model="bundled", output_dir=str(tmp_path / "epoch-001" / "train"), version="v1",
                         args={"max_steps": 3, "batch_size": 1, "threads": 2, "learning_rate": 1e-3,
                               "lora": {"r": 2, "alpha": 4, "layers": "top:1"}})
    trainers = Trainers()
    artefact = trainers.train("trl_sft", records(tmp_path / "curated.jsonl"), config, tick)
    bar.done(loss=f"{artefact.metrics['train_loss']:.4f}", steps=int(artefact.metrics["steps"]))

    assert artefact.metrics["steps"] == 3.0
    last = read_progress(config.output_dir)
    assert last is not None and (last["step"], last["steps"]) == (3, 3)
    assert last["loss"] > 0 and last["tokens"] > 0 and last["elapsed_s"] > 0
    assert seen and all(p["steps"] == 3 and 0 <= p["step"] <= 3 for p in seen)
    assert [p["step"] for p in seen] == sorted(p["step"] for p in seen)  # never backwards
    text = shown.getvalue()
    trained = [p for p in seen if p["step"] > 0]
    assert trained, f"no step was seen while the trainer ran: {seen}"
    step = trained[-1]
    assert f"step {step['step']}/3, " in text and " tokens/s, loss " in text, text
    assert f"loss {step['loss']:.4f}" in text
