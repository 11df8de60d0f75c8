"""Grouped-query attention in the varlen path without repeat_kv: k and v keep their kv heads (the kernel, and
SDPA's enable_gqa on the CPU, let each serve several query heads), and the output and gradients are those of
the old path, which repeated them first. On a card, the flash kernel with kv heads unrepeated is the kernel
with them repeated."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers.integrations.sdpa_attention import repeat_kv  # noqa: E402

from rollgym.train.trainers.packed_attention import segment_boundaries, varlen_attention  # noqa: E402

ROWS, HEADS, KV_HEADS, LENGTH, DIM = 2, 6, 2, 12, 8


def inputs(device: str = "cpu", dtype=torch.float32) -> tuple:
    generator = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(ROWS, heads, LENGTH, DIM, generator=generator).to(device, dtype).requires_grad_()
               for heads in (HEADS, KV_HEADS, KV_HEADS))
    bounds, longest = segment_boundaries([[5, 4], [7]], LENGTH)  # two rollouts and padding; one and padding
    return q, k, v, torch.tensor(bounds, dtype=torch.int32, device=device), longest


def attend(q, k, v, bounds, longest, repeat: bool):
    groups = HEADS // KV_HEADS
    if repeat:  # the old path: each kv head copied for its query heads first
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    out, _ = varlen_attention(None, q, k, v, None, scaling=DIM ** -0.5, cu_seq_lens_q=bounds, max_length_q=longest)
    return out


def output_and_gradients(device: str, dtype, repeat: bool) -> list:
    q, k, v, bounds, longest = inputs(device, dtype)
    out = attend(q, k, v, bounds, longest, repeat)
    (out.float() * torch.linspace(-1, 1, out.numel(), device=device).reshape(out.shape)).sum().backward()
    return [out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()]


def test_the_varlen_path_without_repeat_kv_gives_the_old_outputs_and_gradients() -> None:
    new = output_and_gradients("cpu", torch.float32, repeat=False)
    old = output_and_gradients("cpu", torch.float32, repeat=True)
    assert new[0].shape == (ROWS, LENGTH, HEADS, DIM)
    for name, a, b in zip(("output", "dq", "dk", "dv"), new, old):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), (name, (a - b).abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_flash_kernel_takes_kv_heads_unrepeated() -> None:
    new = output_and_gradients("cuda", torch.bfloat16, repeat=False)
    old = output_and_gradients("cuda", torch.bfloat16, repeat=True)
    for name, a, b in zip(("output", "dq", "dk", "dv"), new, old):
        assert (a - b).abs().max() < 2e-2, (name, (a - b).abs().max())
