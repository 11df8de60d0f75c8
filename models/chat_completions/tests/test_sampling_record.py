"""The sampling record on a generated item states what the backend was sent, not what the client asked
for: extra_body's sampling keys count, and every sampling key a token backend could otherwise fill in
from the model's generation_config is sent at its neutral value. Real HTTP in front of the scripted
backend; the bodies the model server posts are captured on their way out."""

from __future__ import annotations

from typing import Any

import httpx

from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from rollgym.testing import scripted_backend, serve_in_thread

REQUEST = {"input": [{"role": "user", "content": "Hello there"}], "temperature": 0.8}


def generated(extra_body: dict[str, Any]) -> dict[str, Any]:
    with scripted_backend("--token-info") as backend:
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", return_token_ids=True,
                                                           extra_body=extra_body), name="policy_model")
        with serve_in_thread(model) as url, httpx.Client(base_url=url, timeout=10.0) as http:
            reply = http.post("/v1/responses", json=REQUEST)
            assert reply.status_code == 200, reply.text
            return reply.json()["output"][-1]


def test_the_record_states_extra_body_sampling(sent) -> None:
    item = generated({"top_k": 20, "repetition_penalty": 1.1})
    assert item["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 20, "logprobs": "raw",
                                "repetition_penalty": 1.1}
    chat = [body for body in sent if "messages" in body][-1]
    assert chat["top_k"] == 20 and chat["repetition_penalty"] == 1.1 and chat["temperature"] == 0.8


def test_a_token_backend_is_sent_neutral_values_for_what_the_request_leaves_out(sent) -> None:
    item = generated({})
    assert item["sampling"] == {"temperature": 0.8, "top_p": 1.0, "top_k": 0, "logprobs": "raw"}
    chat = [body for body in sent if "messages" in body][-1]
    assert {key: chat[key] for key in ("top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                                       "frequency_penalty")} == {"top_p": 1.0, "top_k": -1, "min_p": 0.0,
                                                                 "repetition_penalty": 1.0, "presence_penalty": 0.0,
                                                                 "frequency_penalty": 0.0}
