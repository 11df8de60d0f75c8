"""fp32 matmul precision is set per phase, not for the process: the trainer's TF32 (CUDA, default precision)
holds inside its steps only and the setting it found is back afterwards, so a fp32 model server sharing the
process (co-locate mode) is not served in TF32. Asserted on torch's own flags, on the CPU."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from rollgym.matmul_precision import FULL, TF32, fp32_matmuls, trainer_fp32_matmuls  # noqa: E402
from rollgym.train.trainers.grpo_config import GRPOConfig  # noqa: E402
from rollgym.train.trainers.grpo_trainer import PolicyTrainer  # noqa: E402

from .hsdp_worker import batch  # noqa: E402


@pytest.fixture(autouse=True)
def process_setting():
    """Each test starts from torch's default and leaves it as found."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def test_a_phase_sets_the_flags_and_restores_them_even_on_error() -> None:
    with fp32_matmuls(TF32):
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.allow_tf32  # what cuBLAS reads
        with fp32_matmuls(FULL):  # a server's step inside a trainer's phase, and the other way round
            assert torch.get_float32_matmul_precision() == "highest"
            assert not torch.backends.cuda.matmul.allow_tf32
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(RuntimeError, match="boom"), fp32_matmuls(TF32):
        raise RuntimeError("boom")
    assert not torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("high")
    with fp32_matmuls(None):  # None changes nothing
        assert torch.get_float32_matmul_precision() == "high"
    with pytest.raises(ValueError, match="'medium'"), fp32_matmuls("medium"):  # type: ignore[arg-type]
        pass


def test_the_trainer_asks_tf32_only_on_cuda_at_its_default_precision() -> None:
    assert trainer_fp32_matmuls("cuda", None) == TF32
    assert trainer_fp32_matmuls("cuda", "fp32") == FULL  # fp32 named means fp32
    assert trainer_fp32_matmuls("cuda", "bf16") == FULL
    assert trainer_fp32_matmuls("cpu", None) is None  # a CPU's setting is left as it is
    assert trainer_fp32_matmuls("cpu", "fp32") is None


def test_the_trainer_steps_under_its_setting_and_leaves_the_process_as_it_found_it(tiny_model: str) -> None:
    trainer = PolicyTrainer(GRPOConfig(finetune="full", micro_batch_tokens=24), tiny_model, seed=1)
    assert trainer.fp32_matmuls is None  # on the CPU
    trainer.load(None)
    trainer.fp32_matmuls = TF32  # what it picks on CUDA at the default precision
    seen: list[str] = []
    trainer.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_float32_matmul_precision()))
    trainer.train_batch(batch(4))
    assert seen and set(seen) == {"high"}
    assert torch.get_float32_matmul_precision() == "highest"  # nothing reaches what runs after the step
    seen.clear()
    trainer._logprobs_no_grad(batch(2))  # π_old's pass, as bench_train calls it
    assert set(seen) == {"high"} and torch.get_float32_matmul_precision() == "highest"
