"""`compile: true` compiles each decoder layer (torch.compile, regional) and the step is the eager one: the
same loss and gradient within fp32 rounding on a tiny random Llama, over packed rows of different shapes."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollgym.train.trainers.grpo_trainer import decoder_layers  # noqa: E402
from tests.train.trainers.test_grpo_packing import sgd_step  # noqa: E402


def test_compiled_decoder_layers_give_the_eager_step(tiny_model) -> None:
    eager, eager_metrics, _ = sgd_step(tiny_model, seq_len=32, micro_batch_tokens=40)
    compiled, compiled_metrics, trainer = sgd_step(tiny_model, seq_len=32, micro_batch_tokens=40, compile=True)
    layers = decoder_layers(trainer.module.causal())
    assert layers and all(layer._compiled_call_impl is not None for layer in layers)
    assert compiled_metrics["tokens"] == eager_metrics["tokens"]
    assert compiled_metrics["loss"] == pytest.approx(eager_metrics["loss"], rel=1e-5)
    assert all(torch.allclose(compiled[n], eager[n], atol=1e-6, rtol=1e-4) for n in eager)
    assert any(eager[n].abs().max() > 1e-4 for n in eager)  # the step moved the weights
