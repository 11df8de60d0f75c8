"""An objective of one's own, written in a file outside the tree (a package in tmp_path, on sys.path) and named
by import path in `loss.objective`: a plan with it passes `rollgym train --check`, one that names a missing one
exits 2 naming it, and the trainer takes its steps with it on a tiny random causal LM: the step's loss is the
objective's own formula on the trainer's logprobs, its settings come from the plan's `loss` keys, and its named
statistics reach the step's metrics (a `_max` one reduced by max)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, sequences_of  # noqa: E402
from rollgym.train.trainers.objectives import find_objective  # noqa: E402

from tests.train.trainers.test_grpo_trainer import LORA, groups  # noqa: E402

PACKAGE = "own_objective_pkg"
SOURCE = '''
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, Field

from rollgym.train.trainers.objectives import LossInputs, LossOutputs, Objective


class ReinforceConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    beta: float = Field(default=1.0, gt=0)


class Reinforce(Objective):
    """Plain REINFORCE: -beta * A * log pi, no ratio to the sampling policy."""

    name: ClassVar[str] = "reinforce"
    Config = ReinforceConfig
    statistics: ClassVar[tuple[str, ...]] = ("logprob_sum", "advantage_max")

    def __call__(self, inputs: LossInputs) -> LossOutputs:
        loss = -(self.config.beta * inputs.advantages * inputs.logprobs * inputs.scales).sum()
        stats = torch.stack([inputs.logprobs.detach().sum(), inputs.advantages.max()]).double()
        return LossOutputs(loss, int(inputs.logprobs.numel()), stats, self.statistics)
'''


@pytest.fixture
def own_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The objective's package, importable from tmp_path only (outside the repository)."""
    root = tmp_path / "elsewhere"
    (root / PACKAGE).mkdir(parents=True)
    (root / PACKAGE / "__init__.py").write_text("")
    (root / PACKAGE / "loss.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(root))
    yield f"{PACKAGE}.loss:Reinforce"
    for name in [name for name in sys.modules if name.startswith(PACKAGE)]:
        del sys.modules[name]


def test_the_trainer_takes_steps_with_an_objective_from_outside_the_tree(own_package: str, tiny_model: str) -> None:
    assert find_objective(own_package).__module__ == f"{PACKAGE}.loss"
    args = GRPOConfig(learning_rate=1e-2, lora=LORA, groups_per_step=1,
                      loss={"objective": own_package, "beta": 2.0})
    assert args.loss.beta == 2.0 and args.loss.kl_beta == 0.0
    trainer = PolicyTrainer(args, tiny_model, seed=1)
    trainer.load(None)
    data = groups(1, count=1)
    batch = [seq for group in sequences_of(data) for seq in group]
    before = torch.cat(trainer._logprobs_no_grad(batch))
    advantages = torch.tensor([seq.advantage for seq in batch for keep in seq.loss_mask if keep])
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    metrics = trainer.train_records(data)

    tokens = sum(seq.loss_tokens for seq in batch)  # token_mean: every token weighs 1 / tokens
    assert metrics["loss"] == pytest.approx(float(-(2.0 * advantages * before).sum() / tokens), rel=1e-5)
    assert metrics["logprob_sum"] == pytest.approx(float(before.sum()) / tokens, rel=1e-5)  # a sum, per token
    assert metrics["advantage_max"] == 1.0 and metrics["optimizer_step"] == 1.0
    assert "importance_ratio_mean" not in metrics  # the built-ins' statistics are theirs
    assert any(not torch.equal(weights[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad)
    second = trainer.train_records(groups(2, count=2))
    assert second["steps"] == 2.0 and second["optimizer_step"] == 3.0


def test_its_settings_are_checked_by_its_own_model(own_package: str) -> None:
    with pytest.raises(ValueError, match="beta"):
        GRPOConfig(loss={"objective": own_package, "beta": -1.0})
    with pytest.raises(ValueError, match="clip_low is a setting of objective: ppo_tis"):
        GRPOConfig(loss={"objective": own_package, "clip_low": 0.1})
    with pytest.raises(ValueError, match="'builtins:dict' is not an objective"):
        GRPOConfig(loss={"objective": "builtins:dict"})


def test_train_check_imports_it_and_names_a_missing_one(own_package: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    from tests.cli.test_train_check import check, demo, write

    data = demo(tmp_path)
    data["stages"][1]["optimize"]["args"]["loss"] = {"objective": own_package, "beta": 0.5}
    code, out, err = check(capsys, write(tmp_path, data))
    assert code == 0, err
    data["stages"][1]["optimize"]["args"]["loss"] = {"objective": f"{PACKAGE}.missing:Reinforce"}
    code, out, err = check(capsys, write(tmp_path, data))
    assert code == 2 and out == ""
    assert "stages[1].optimize" in err and f"cannot import '{PACKAGE}.missing:Reinforce'" in err, err
