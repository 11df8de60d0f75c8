"""`POST /v1/score` through chat_completions to a vLLM-shaped backend (the scripted one, over real HTTP): the
completion's part of vLLM's `prompt_logprobs`, the token's own entry at each position; a backend that
answers none is a 502 with the cause, never zeros."""

from __future__ import annotations

from typing import Iterator

import httpx
import pytest

from rollgym.testing import serve_in_thread
from rollgym.testing.scripted_vllm import _logprob

from models.chat_completions.tests.test_app import make_model, post_ok, scripted_backend


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
