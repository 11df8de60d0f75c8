"""The transformers model server on a CUDA device (skipped without one): batched generations whose logprobs
match one plain forward pass over their tokens, in fp32 and in bf16 (the default on cuda), and an adapter.
The process is set to TF32 meanwhile, as a trainer sharing it sets it for its steps: a fp32 server still
serves in fp32 (the reference pass is run in full fp32)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest

torch = pytest.importorskip("torch", reason="the transformers model server needs torch")
pytest.importorskip("transformers", reason="the transformers model server needs transformers")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
try:
    from rollgym.train.trainers.policy import bundled_gguf

    bundled_gguf()
except FileNotFoundError as exc:
    pytest.skip(str(exc), allow_module_level=True)

from rollgym.matmul_precision import FULL, TF32, fp32_matmuls  # noqa: E402
from rollgym.testing import serve_in_thread  # noqa: E402

from models.transformers.app import TransformersConfig, TransformersModel  # noqa: E402
from models.transformers.tests.test_app import record, teacher_forced, write_adapter  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BODIES = [{"input": "Name three colours.", "temperature": 0.7, "top_p": 0.9, "seed": 5, "max_output_tokens": 16},
          {"input": "Write one sentence about the sea at dawn.", "temperature": 1.0, "seed": 6, "max_output_tokens": 16},
          {"input": "Say hi.", "temperature": 0, "max_output_tokens": 16}]


def generate_together(url: str) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            replies = await asyncio.gather(*(http.post("/v1/responses", json=body) for body in BODIES))
        assert all(reply.status_code == 200 for reply in replies), [reply.text for reply in replies]
        return [reply.json() for reply in replies]

    return asyncio.run(run())


@pytest.mark.parametrize(("dtype", "tolerance"), [("fp32", 2e-3), ("bf16", 0.15)])
def test_batched_logprobs_on_cuda_match_a_forward_pass(dtype: str, tolerance: float, tmp_path: Path) -> None:
    model = TransformersModel(TransformersConfig(n_ctx=1024, dtype=dtype), name="policy_model")
    with fp32_matmuls(TF32), serve_in_thread(model, timeout_s=300) as url:
        assert model.engine.device.type == "cuda"
        for body, response in zip(BODIES, generate_together(url)):
            item = record(response)
            with fp32_matmuls(FULL):
                processed, raw = teacher_forced(model.engine.model, item["prompt_token_ids"],
                                                item["generation_token_ids"], temperature=body["temperature"] or 1.0,
                                                top_p=body.get("top_p", 1.0))
            expected = raw if body["temperature"] == 0 else processed
            gaps = [abs(a - b) for a, b in zip(item["generation_log_probs"], expected)]
            # bf16: the batched, cached decode and the one-pass forward round differently; on average they agree.
            assert sum(gaps) / len(gaps) < tolerance and max(gaps) < 10 * tolerance, (dtype, gaps)
        loaded = httpx.post(f"{url}/v1/load_lora_adapter", timeout=120,
                            json={"lora_name": "step-1", "lora_path": str(write_adapter(tmp_path / "step-1"))})
        assert loaded.status_code == 200, loaded.text
        tuned = httpx.post(f"{url}/v1/responses", json=BODIES[2], timeout=120).json()
        assert tuned["model_version"] == loaded.json()["model_version"]
