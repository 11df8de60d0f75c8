"""The trainer's step defaults (step_settings): on CUDA compile and the largest micro-batch whose estimated peak
fits the free memory less the margin, from made-up devices; on a CPU what it always ran with; given values kept."""

from __future__ import annotations

import pytest

from rollgym.train.trainers.grpo_config import GRPOConfig
from rollgym.train.trainers.step_settings import Memory, ModelShape, peak_bytes, step_settings

GIB = 2**30
QWEN_1_5B = ModelShape(params=1_543_714_304, hidden=1536, layers=28)
QWEN_3B = ModelShape(params=3_085_938_688, hidden=2048, layers=36)
QWEN_7B = ModelShape(params=7_615_616_512, hidden=3584, layers=28)
H200 = Memory(total_bytes=140 * GIB, free_bytes=139 * GIB)
H100 = Memory(total_bytes=80 * GIB, free_bytes=79 * GIB)


def test_on_a_cpu_nothing_changes() -> None:
    picked = step_settings("cpu", None, QWEN_1_5B, "full", None, None)
    assert (picked.compile, picked.micro_batch_tokens) == (False, 4096)
    assert GRPOConfig().micro_batch_tokens is None and GRPOConfig().compile is None  # unset: the device decides
    given = step_settings("cpu", None, QWEN_1_5B, "lora", True, 128)
    assert (given.compile, given.micro_batch_tokens) == (True, 128)


@pytest.mark.parametrize(("memory", "shape", "finetune", "tokens"), [
    (H200, QWEN_1_5B, "full", 16384),  # what measured best on the H200
    (H100, QWEN_1_5B, "full", 8192),  # 16k's estimate (~81 GiB) is over 80 GiB less 10 %
    (H100, QWEN_1_5B, "lora", 16384),  # LoRA: no gradients or moments for the base
    (Memory(80 * GIB, 30 * GIB), QWEN_1_5B, "lora", 4096),  # another process holds most of the card
    (H200, QWEN_3B, "full", 8192),  # 3B full: 46 GiB of fixed state, 16k's activations would not fit
])
def test_on_cuda_compile_and_the_largest_micro_batch_that_fits(memory: Memory, shape: ModelShape, finetune: str,
                                                               tokens: int) -> None:
    picked = step_settings("cuda", memory, shape, finetune, None, None)
    assert picked.compile is True and picked.micro_batch_tokens == tokens, picked.why
    budget = memory.free_bytes - 0.1 * memory.total_bytes
    assert peak_bytes(shape, finetune, tokens, True) <= budget
    if tokens < 16384:  # the next size up would not have fitted
        assert peak_bytes(shape, finetune, tokens * 2, True) > budget
    assert f"{tokens}-token" in picked.why and "GiB" in picked.why


def test_on_cuda_given_values_are_kept_and_a_model_too_large_is_named() -> None:
    given = step_settings("cuda", H200, QWEN_1_5B, "full", False, 2048)
    assert (given.compile, given.micro_batch_tokens) == (False, 2048) and "as given" in given.why
    eager = step_settings("cuda", H100, QWEN_1_5B, "full", False, None)  # eager saves more: a smaller batch fits
    assert eager.compile is False and eager.micro_batch_tokens == 4096
    too_big = step_settings("cuda", H200, QWEN_7B, "full", None, None)  # 113 GiB of fixed state alone
    assert too_big.micro_batch_tokens == 4096 and "does not fit" in too_big.why
    with pytest.raises(ValueError, match="memory"):
        step_settings("cuda", None, QWEN_1_5B, "full", None, None)
    with pytest.raises(ValueError, match="'qlora'"):
        step_settings("cuda", H200, QWEN_1_5B, "qlora", None, None)
