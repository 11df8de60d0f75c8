"""Sequence packing (`seq_len`): several rollouts share a row, with position ids restarting at each, and
the step is the unpacked one: the same logprobs, loss and gradient within fp32 rounding, on a tiny
random Llama whose attention would otherwise let a rollout see the one packed before it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers import token_logprobs  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer, TrainSequence  # noqa: E402
from rollgym.train.trainers.packed_attention import NAME, segment_boundaries, use_varlen  # noqa: E402


def batch() -> list[TrainSequence]:
    generator = torch.Generator().manual_seed(7)
    out = []
    for i, (prompt, completion) in enumerate([(5, 6), (3, 14), (7, 4), (4, 7), (2, 9)]):
        ids = torch.randint(0, 40, (prompt + completion,), generator=generator).tolist()
        mask = [1] * completion
        mask[1] = 0
        logprobs = (-3.7 + (torch.rand(completion, generator=generator) - 0.5) * 0.6).tolist()
        out.append(TrainSequence(ids[:prompt], ids[prompt:], mask, logprobs,
                                 advantage=[1.0, -0.5, 0.8, -1.2, 0.3][i], temperature=0.9))
    return out


def sgd_step(tiny_model: str, **args) -> tuple[dict, dict, PolicyTrainer]:
    """One step with plain SGD at lr 1, so each weight moves by exactly −gradient."""
    trainer = PolicyTrainer(GRPOConfig(finetune="full", max_grad_norm=None, **args), tiny_model)
    trainer.load(None)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    metrics = trainer.train_batch(batch())
    gradient = {n: before[n] - p.detach() for n, p in trainer.model.named_parameters()}
    return gradient, metrics, trainer


def test_packed_rows_give_the_unpacked_logprobs_loss_and_gradient(tiny_model) -> None:
    plain, plain_metrics, trainer = sgd_step(tiny_model)
    packed, packed_metrics, packer = sgd_step(tiny_model, seq_len=32, micro_batch_tokens=40)

    rows = packer._tensors(batch())
    assert rows["input_ids"].shape[0] < len(batch()) and rows["input_ids"].shape[1] <= 32  # several per row
    assert rows["attention_mask"] is None and rows["position_ids"][0].tolist().count(0) >= 2
    assert packed_metrics["tokens"] == plain_metrics["tokens"] == sum(s.loss_tokens for s in batch())
    assert packed_metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-5)
    assert all(torch.allclose(packed[n], plain[n], atol=1e-6, rtol=1e-4) for n in plain)
    assert any(plain[n].abs().max() > 1e-4 for n in plain)  # the step moved the weights

    fresh = PolicyTrainer(GRPOConfig(finetune="full"), tiny_model)
    fresh.load(None)
    fresh_packer = PolicyTrainer(GRPOConfig(finetune="full", seq_len=32), tiny_model)
    fresh_packer.load(None)
    with torch.no_grad():
        unpacked_logprobs = fresh._forward(fresh._tensors(batch()))
        packed_logprobs = fresh_packer._forward(fresh_packer._tensors(batch()))
    assert torch.allclose(packed_logprobs, unpacked_logprobs, atol=1e-5)
    # Without the restarting positions (one causal run over the row), the later rollouts of a row differ.
    tensors = fresh_packer._tensors(batch())
    tensors["position_ids"] = None
    with torch.no_grad():
        crossing = fresh_packer._forward(tensors)
    assert not torch.allclose(crossing, unpacked_logprobs, atol=1e-3)


def test_segment_boundaries_cover_each_rollout_and_each_rows_padding() -> None:
    assert segment_boundaries([[5, 3], [6]], width=8) == ([0, 5, 8, 14, 16], 6)
    assert segment_boundaries([[4, 4]], width=8) == ([0, 4, 8], 4)


def varlen_sgd_step(tiny_model: str) -> tuple[dict, dict, PolicyTrainer]:
    """sgd_step with the packed rows on the varlen attention: on the CPU its per-segment reference, so
    what is checked is the wiring (boundaries computed, handed to every layer, outputs laid out back)."""
    trainer = PolicyTrainer(GRPOConfig(finetune="full", max_grad_norm=None, seq_len=32, micro_batch_tokens=40),
                            tiny_model)
    trainer.load(None)
    assert not trainer.varlen  # on the CPU the masked SDPA path is the default
    trainer.varlen = use_varlen(trainer.model)
    assert trainer.varlen and trainer.model.config._attn_implementation == NAME
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    metrics = trainer.train_batch(batch())
    return {n: before[n] - p.detach() for n, p in trainer.model.named_parameters()}, metrics, trainer


def test_the_varlen_attention_gives_the_unpacked_step(tiny_model) -> None:
    plain, plain_metrics, _ = sgd_step(tiny_model)
    varlen, varlen_metrics, trainer = varlen_sgd_step(tiny_model)
    segments = trainer._tensors(batch())["segments"]
    assert segments is not None and segments[0].dtype == torch.int32
    assert varlen_metrics["loss"] == pytest.approx(plain_metrics["loss"], rel=1e-5)
    assert all(torch.allclose(varlen[n], plain[n], atol=1e-6, rtol=1e-4) for n in plain)
    # A forward call without the boundaries is refused, not computed as one causal run over the row.
    tensors = trainer._tensors(batch())
    tensors["segments"] = None
    with pytest.raises(RuntimeError, match="packed rows only"), torch.no_grad():
        trainer._forward(tensors)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_varlen_kernel_on_cuda_matches_the_masked_attention(tiny_model) -> None:
    # Eager (CUDA's default compiles): the attention kernels are compared, not the compiler's fusions.
    masked = PolicyTrainer(GRPOConfig(finetune="full", seq_len=32, precision="bf16", compile=False), tiny_model)
    masked.load(None)
    masked.model.set_attn_implementation("sdpa")
    masked.varlen = False
    flash = PolicyTrainer(GRPOConfig(finetune="full", seq_len=32, precision="bf16", compile=False), tiny_model)
    flash.load(None)
    assert flash.varlen  # packed, bf16, on a GPU: on by default
    with torch.no_grad():
        reference = masked._forward(masked._tensors(batch()))
        fast = flash._forward(flash._tensors(batch()))
    assert (fast - reference).abs().mean() < 2e-2, (fast - reference).abs().max()
    flash.module.precision = "fp32"  # autocast off (the bench's bf16-gap pass): fp32 in, fp32 out of the kernel
    with torch.no_grad():
        assert (flash._forward(flash._tensors(batch())) - reference).abs().mean() < 2e-2
    flash.module.precision = "bf16"
    flash.train_batch(batch())  # and its backward runs


def test_the_softmax_in_chunks_gives_the_whole_ones_logprobs_and_gradient(tiny_model, monkeypatch) -> None:
    whole, whole_metrics, _ = sgd_step(tiny_model)
    monkeypatch.setattr(token_logprobs, "LOGIT_CHUNK", 7)  # several chunks, the last one short
    chunked, chunked_metrics, _ = sgd_step(tiny_model)
    assert chunked_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=1e-6)
    assert all(torch.allclose(chunked[n], whole[n], atol=1e-7, rtol=1e-5) for n in whole)
