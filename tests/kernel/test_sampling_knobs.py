"""min_tokens and repetition_penalty at the model-server boundary: a server that applies them records them on
every generated item; one that does not refuses them (422 naming the key) rather than record tokens it did not
sample under them. Real HTTP on loopback."""

from __future__ import annotations

from typing import Any, ClassVar

import httpx
import pytest

from rollgym import ModelServer, build_response
from rollgym.testing import serve_in_thread

TOKENS = {"prompt_token_ids": [1, 2], "generation_token_ids": [3, 4], "generation_log_probs": [-0.5, -0.25]}


class Echo(ModelServer):
    """Generates one message with a token record; applies what `applies` says."""

    applies: ClassVar[frozenset[str]] = frozenset()

    async def responses(self, params: Any, payload: dict[str, Any]) -> dict[str, Any]:
        item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": "hi", "annotations": []}], **TOKENS}
        return build_response(payload, [item], model="echo", logprobs_mode="processed")

    async def chat_completions(self, payload: dict[str, Any]) -> dict[str, Any]:
        return {"choices": []}


class Applying(Echo):
    applies = frozenset({"min_tokens", "repetition_penalty"})


def post(server: ModelServer, path: str, body: dict[str, Any]) -> httpx.Response:
    with serve_in_thread(server) as url, httpx.Client(base_url=url, timeout=10.0) as http:
        return http.post(path, json=body)


@pytest.mark.parametrize("knob", [{"min_tokens": 8}, {"repetition_penalty": 1.1}])
def test_a_server_that_does_not_apply_a_knob_refuses_it_by_name(knob: dict[str, Any]) -> None:
    for path, body in (("/v1/responses", {"input": "hi", **knob}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **knob})):
        reply = post(Echo(name="embedded"), path, body)
        assert reply.status_code == 422, reply.text
        [key] = knob
        assert key in reply.text and "does not apply" in reply.text


def test_neutral_values_pass_and_malformed_ones_are_refused_by_name() -> None:
    reply = post(Echo(name="embedded"), "/v1/responses", {"input": "hi", "min_tokens": 0, "repetition_penalty": 1.0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["output"][0]["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0,
                                                     "logprobs": "processed"}
    for body, key in (({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 2.5}, "min_tokens"),
                      ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": "x"}, "repetition_penalty")):
        reply = post(Applying(name="vllm"), "/v1/responses", {"input": "hi", **body})
        assert reply.status_code == 422 and key in reply.text, reply.text


def test_a_server_that_applies_them_records_them_on_every_generated_item() -> None:
    reply = post(Applying(name="vllm"), "/v1/responses",
                 {"input": "hi", "temperature": 0.7, "min_tokens": 8, "repetition_penalty": 1.1})
    assert reply.status_code == 200, reply.text
    assert reply.json()["output"][0]["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0,
                                                     "logprobs": "processed", "min_tokens": 8,
                                                     "repetition_penalty": 1.1}
