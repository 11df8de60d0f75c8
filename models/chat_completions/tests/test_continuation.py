"""In-flight weight updates on the scripted backend: a generation aborted by `/pause?mode=abort` is continued
on the new weights as one answer, token-exact, with a version span per segment; and the faults a real vLLM
cannot be made to show on cue (an abort before the first token, an engine that stays paused).

The scripted backend mimics vLLM's dev-mode routes as read in vLLM 0.32 and checked against it
(tests/test_inflight_vllm.py runs the same against the real server): while paused a request waits, an abort
answers `finish_reason: "abort"` with the tokens generated so far, and a prompt that extends an aborted one
by its tokens gets the rest of the generation. Like vLLM's /v1/completions, its answers carry no weight
version: the model server reports its own (`model_version`), which a reload through it updates; here the
test changes it while the engine is paused, as a reload does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.schema import ModelResponse
from rollgym.testing import scripted_backend, serve_in_thread

LATENCY_MS = 1000
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "strict": False}


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    with scripted_backend("--latency-ms", str(LATENCY_MS)) as url:
        yield url


@contextmanager
def model_on(backend: str, **config: Any) -> Iterator[tuple[httpx.Client, ChatCompletionsModel]]:
    model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True,
                                                       model_version="v1", **config), name="policy_model")
    with serve_in_thread(model) as url, httpx.Client(base_url=url, timeout=30.0) as client:
        yield client, model


def second_turn_input(client: httpx.Client) -> list[dict[str, Any]]:
    """A weather conversation through its tool call: the next turn goes to /v1/completions as token ids."""
    start = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.post("/v1/responses", json={"input": start, "tools": [TOOL]})
    assert first.status_code == 200, first.text
    call = first.json()["output"][-1]
    return start + first.json()["output"] + [
        {"type": "function_call_output", "call_id": call["call_id"], "output": "snowy and windy, -3 C, all week"}]


def answer_while(client: httpx.Client, body: dict[str, Any], during: Any) -> httpx.Response:
    """POST /v1/responses while `during()` runs beside it (the pause, the reload, the resume)."""
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault("reply", client.post("/v1/responses", json=body)))
    worker.start()
    try:
        during()
    finally:
        worker.join(timeout=60)
    return result["reply"]


def pause(root: str, keep: int) -> None:
    """Pause with abort once the backend is generating; the generation keeps `keep` tokens (the scripted
    backend's knob: a real abort keeps what the elapsed time produced)."""
    deadline = time.monotonic() + 30
    with httpx.Client() as http:
        while not http.get(f"{root}/scripted/running").json()["running"] and time.monotonic() < deadline:
            time.sleep(0.005)
        reply = http.post(f"{root}/pause", params={"mode": "abort", "scripted_keep": keep})
    assert reply.json() == {"status": "paused"}


def resume(root: str) -> None:
    assert httpx.post(f"{root}/resume").json() == {"status": "resumed"}


def generated(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    ModelResponse.model_validate(reply.json())
    return reply.json()["output"][-1]


def test_an_aborted_generation_goes_on_on_the_new_weights_as_one_answer(backend):
    root = backend.removesuffix("/v1")
    with model_on(backend, continue_aborted=True) as (client, model):
        body = {"input": second_turn_input(client), "tools": [TOOL]}
        plain = generated(client.post("/v1/responses", json=body))

        def reload() -> None:  # pause with abort halfway, new weights and version, resume
            pause(root, keep=12)
            model.config.model_version = "v2"
            httpx.post(f"{root}/update_weight_version", json={"new_version": "v2"}).raise_for_status()
            time.sleep(0.3)
            resume(root)

        continued = generated(answer_while(client, body, reload))
        model.config.model_version = "v1"
        httpx.post(f"{root}/update_weight_version", json={"new_version": ""})
    ids, logprobs = continued["generation_token_ids"], continued["generation_log_probs"]
    # One generation, token for token the one the pause interrupted: the next turn extends it as ever.
    assert continued["prompt_token_ids"] == plain["prompt_token_ids"]
    assert ids == plain["generation_token_ids"] and len(logprobs) == len(ids)
    assert continued["content"][0]["text"] == plain["content"][0]["text"]
    spans = continued["model_version_spans"]
    assert [span["model_version"] for span in spans] == ["v1", "v2"]
    before = spans[0]["tokens"]
    assert before == 12 and before + spans[1]["tokens"] == len(ids)
    # Each token keeps the logprob of the weights that sampled it: v1's before the pause, v2's after.
    assert logprobs[:before] == plain["generation_log_probs"][:before]
    assert logprobs[before:] != plain["generation_log_probs"][before:]
    assert continued["model_version"] == "v2"


def test_an_abort_before_the_first_token_continues_with_one_span(backend):
    root = backend.removesuffix("/v1")
    with model_on(backend, continue_aborted=True) as (client, model):
        body = {"input": second_turn_input(client), "tools": [TOOL]}
        plain = generated(client.post("/v1/responses", json=body))

        def reload() -> None:
            pause(root, keep=0)  # as vLLM aborts a request still in its prefill
            model.config.model_version = "v2"
            resume(root)

        continued = generated(answer_while(client, body, reload))
        model.config.model_version = "v1"
    assert continued["generation_token_ids"] == plain["generation_token_ids"]
    assert continued["model_version_spans"] == [{"model_version": "v2",
                                                 "tokens": len(plain["generation_token_ids"])}]


def test_an_engine_paused_past_the_bound_is_an_error_naming_it(backend):
    root = backend.removesuffix("/v1")
    with model_on(backend, continue_aborted=True, resume_wait_s=0.5) as (client, _):
        body = {"input": second_turn_input(client), "tools": [TOOL]}
        try:
            reply = answer_while(client, body, lambda: pause(root, keep=12))
        finally:
            resume(root)
    assert reply.status_code == 503
    assert "still paused" in reply.text and "resume_wait_s is 0.5" in reply.text


def test_without_continue_aborted_an_abort_is_an_error_not_a_cut_answer(backend):
    root = backend.removesuffix("/v1")
    with model_on(backend) as (client, _):
        body = {"input": second_turn_input(client), "tools": [TOOL]}

        def reload() -> None:
            pause(root, keep=12)
            resume(root)

        reply = answer_while(client, body, reload)
    assert reply.status_code == 502 and "aborted the generation" in reply.text


def test_continue_aborted_needs_vllm_and_token_ids():
    with pytest.raises(ValidationError, match="continue_aborted"):
        ChatCompletionsConfig(base_url="http://127.0.0.1:1/v1", model="m", backend="sglang", return_token_ids=True,
                              continue_aborted=True)
    with pytest.raises(ValidationError, match="continue_aborted"):
        ChatCompletionsConfig(base_url="http://127.0.0.1:1/v1", model="m", continue_aborted=True)
