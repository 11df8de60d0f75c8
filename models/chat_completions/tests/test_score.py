"""`POST /v1/score` through chat_completions to the scripted backend over real HTTP: vLLM-shaped, the
completion's part of vLLM's `prompt_logprobs` (the token's own entry at each position); SGLang-shaped, the
completion's part of `/generate`'s `input_token_logprobs`, an adapter asked for by its `lora_path`; a
backend that answers none is a 502 with the cause, never zeros."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from rollgym.testing import serve_in_thread
from rollgym.testing.scripted_vllm import _logprob

from models.chat_completions.tests.test_app import make_model, post_ok, scripted_backend
from models.chat_completions.tests.test_adapters import pool
from models.chat_completions.tests.test_backends import backend_log


@pytest.fixture(scope="module")
def client() -> Iterator[httpx.Client]:
    with scripted_backend("--token-info") as backend, serve_in_thread(make_model(backend, return_token_ids=True)) as url:
        with httpx.Client(base_url=url, timeout=10.0) as http:
            yield http


def test_scores_are_vllm_prompt_logprobs_of_the_completion(client: httpx.Client) -> None:
    item = post_ok(client, {"input": "Say hello.", "max_output_tokens": 8})["output"][-1]
    prompt, completion = item["prompt_token_ids"], item["generation_token_ids"]
    reply = client.post("/v1/score", json={"prompt_token_ids": prompt, "completion_token_ids": completion})
    assert reply.status_code == 200, reply.text
    # The scripted backend's prompt logprob of token t at position p is _logprob(0, p, t).
    assert reply.json()["logprobs"] == [_logprob(0, len(prompt) + j, t) for j, t in enumerate(completion)]
    reply = client.post("/v1/score", json={"prompt_token_ids": prompt, "completion_token_ids": completion,
                                           "temperature": 0.5})
    assert reply.status_code == 422 and "temperature" in reply.text


def test_a_backend_without_prompt_logprobs_is_a_502_with_the_cause() -> None:
    with scripted_backend("--no-token-routes") as backend, serve_in_thread(make_model(backend)) as url:
        reply = httpx.post(f"{url}/v1/score", json={"prompt_token_ids": [70], "completion_token_ids": [71]}, timeout=10)
    assert reply.status_code in (404, 502), reply.text
    assert "prompt" in reply.text or "completions" in reply.text


def test_scores_behind_sglang_are_its_input_token_logprobs_of_the_completion(tmp_path) -> None:
    with pool(("--token-info", "--shape", "sglang"), backend="sglang") as (client, [backend]):
        root = backend.removesuffix("/v1")
        item = post_ok(client, {"input": "Say hello.", "max_output_tokens": 8})["output"][-1]
        prompt, completion = item["prompt_token_ids"], item["generation_token_ids"]
        expected = [_logprob(0, len(prompt) + j, t) for j, t in enumerate(completion)]
        reply = client.post("/v1/score", json={"prompt_token_ids": prompt, "completion_token_ids": completion})
        assert reply.status_code == 200, reply.text
        assert reply.json()["logprobs"] == expected
        [call] = [entry for entry in backend_log(root) if entry["path"] == "/generate"]
        assert call["body"]["input_ids"] == prompt + completion
        assert call["body"]["logprob_start_len"] == len(prompt) - 1 and call["body"]["lora_path"] is None
        # A one-token prompt: SGLang's entry for position 0 is None, and only the completion's are read.
        reply = client.post("/v1/score", json={"prompt_token_ids": prompt[:1], "completion_token_ids": completion})
        assert reply.json()["logprobs"] == [_logprob(0, 1 + j, t) for j, t in enumerate(completion)]
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "teacher", "lora_path": str(tmp_path)})
        assert loaded.status_code == 200, loaded.text
        reply = client.post("/v1/score", json={"model": "teacher", "prompt_token_ids": prompt,
                                               "completion_token_ids": completion})
        assert reply.status_code == 200 and reply.json()["model"] == "teacher"
        assert [entry for entry in backend_log(root) if entry["path"] == "/generate"][-1]["body"]["lora_path"] == "teacher"
