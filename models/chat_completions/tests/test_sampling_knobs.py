"""min_tokens and repetition_penalty in a Responses request reach the token backend and the sampling record of
the generated item (real HTTP in front of the scripted backend; the bodies posted are captured)."""

from __future__ import annotations

from typing import Any

import httpx

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.testing import scripted_backend, serve_in_thread


def generate(request: dict[str, Any]) -> dict[str, Any]:
    with scripted_backend("--token-info") as backend:
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True),
                                     name="policy_model")
        with serve_in_thread(model) as url, httpx.Client(base_url=url, timeout=10.0) as http:
            reply = http.post("/v1/responses", json={"input": [{"role": "user", "content": "Hello"}], **request})
            assert reply.status_code == 200, reply.text
            return reply.json()["output"][-1]


def test_the_knobs_of_the_request_are_sent_and_recorded(sent) -> None:
    item = generate({"temperature": 0.8, "min_tokens": 5, "repetition_penalty": 1.2})
    assert item["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "logprobs": "raw",
                                "repetition_penalty": 1.2, "min_tokens": 5}
    chat = [body for body in sent if "messages" in body][-1]
    assert chat["min_tokens"] == 5 and chat["repetition_penalty"] == 1.2


def test_left_out_they_are_pinned_neutral_and_not_recorded(sent) -> None:
    item = generate({"temperature": 0.8})
    assert "min_tokens" not in item["sampling"] and "repetition_penalty" not in item["sampling"]
    chat = [body for body in sent if "messages" in body][-1]
    assert chat["min_tokens"] == 0 and chat["repetition_penalty"] == 1.0
