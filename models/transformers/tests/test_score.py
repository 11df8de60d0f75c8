"""`POST /v1/score` on the transformers server, over real HTTP: the teacher-forced logprobs of a generation's
tokens are those it recorded sampling them (temperature 1, no truncation), under the base and an adapter."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

pytest.importorskip("torch", reason="the transformers model server needs torch")
try:
    from rollgym.train.trainers.policy import bundled_gguf

    bundled_gguf()
except FileNotFoundError as exc:
    # test_app skips itself without the weights, and under importlib imports a skipped module's names are
    # absent: the same reason skips this one, before it asks for them.
    pytest.skip(str(exc), allow_module_level=True)

from models.transformers.tests.test_app import served, write_adapter  # noqa: E402, F401 - the module's fixture

pytestmark = pytest.mark.slow


def test_scores_match_the_sampled_logprobs(served: Any, tmp_path) -> None:  # noqa: F811
    model, url = served
    with httpx.Client(base_url=url, timeout=300) as client:
        base = model.model_names()[0]
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "teacher",
                                                           "lora_path": str(write_adapter(tmp_path / "teacher"))})
        assert reply.status_code == 200, reply.text
        try:
            items = {}
            for name in (base, "teacher"):
                reply = client.post("/v1/responses", json={"input": "Name three colours.", "temperature": 1.0,
                                                           "max_output_tokens": 10, "seed": 5, "model": name})
                assert reply.status_code == 200, reply.text
                items[name] = item = reply.json()["output"][-1]
                body = {"model": name, "prompt_token_ids": item["prompt_token_ids"],
                        "completion_token_ids": item["generation_token_ids"]}
                answer = client.post("/v1/score", json=body).json()
                assert answer["logprobs"] == pytest.approx(item["generation_log_probs"], abs=2e-3)
            body = {"model": "teacher", "prompt_token_ids": items[base]["prompt_token_ids"],
                    "completion_token_ids": items[base]["generation_token_ids"]}
            other = client.post("/v1/score", json=body).json()["logprobs"]
            assert max(abs(a - b) for a, b in zip(other, items[base]["generation_log_probs"])) > 0.2
            reply = client.post("/v1/score", json={**body, "completion_token_ids": [10**6]})
            assert reply.status_code == 422 and "tokenizer" in reply.text
        finally:
            client.post("/v1/unload_lora_adapter", json={"lora_name": "teacher"})
