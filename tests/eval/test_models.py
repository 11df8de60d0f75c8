"""What `--model` and `--run` name: a served name, an adapter path (with or without a label), a train run's epochs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollgym.eval.models import BASE, ModelSpec, check_labels, parse_model, run_models
from rollgym.eval.suite import SuiteError


def test_names_paths_and_labels(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    adapter = tmp_path / "step-3" / "adapter"
    adapter.mkdir(parents=True)
    assert parse_model("base") == ModelSpec("base", name="base")
    assert parse_model("Qwen/Qwen3-4B") == ModelSpec("Qwen_Qwen3-4B", name="Qwen/Qwen3-4B")  # a served name
    assert parse_model("./step-3/adapter") == ModelSpec("step-3", adapter=adapter)  # named for its step
    assert parse_model(f"tuned={adapter}") == ModelSpec("tuned", adapter=adapter)
    with pytest.raises(SuiteError, match="no adapter at ./nowhere"):
        parse_model("./nowhere")
    with pytest.raises(SuiteError, match="the label 'a b' may hold"):
        parse_model(f"a b={adapter}")
    with pytest.raises(SuiteError, match="two models are labelled 'x'"):
        check_labels([ModelSpec("x", name="a"), ModelSpec("x", name="b")])


def test_a_train_run_gives_its_base_and_the_epochs_still_on_disk(tmp_path: Path) -> None:
    kept = tmp_path / "epoch-002" / "train" / "adapter"
    kept.mkdir(parents=True)
    lines = [{"epoch": 0, "artefact": None}, {"epoch": 1, "artefact": str(tmp_path / "epoch-001/train/adapter")},
             {"epoch": 2, "artefact": str(kept)}]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert run_models(tmp_path) == [ModelSpec("epoch-0", name=BASE), ModelSpec("epoch-2", adapter=kept.resolve())]
    (tmp_path / "history.jsonl").write_text(json.dumps(lines[0]) + "\n")
    with pytest.raises(SuiteError, match="no epoch's adapter is on disk"):
        run_models(tmp_path)
