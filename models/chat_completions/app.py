"""chat_completions: a Responses API model server in front of any OpenAI-compatible Chat Completions
backend (vLLM, SGLang, llama.cpp server, OpenAI).

Responses requests are converted to chat requests and the chat answers back to Responses output
items by `rollgym.chat_conversion`. With `return_token_ids: true` (vLLM), the backend is asked for
prompt and generated token ids and sampling logprobs, which go on the generated items.
"""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException
from pydantic import Field

from rollgym import ModelServer, ResponsesCreateParams, ServerCallError, ServerConfig, build_response
from rollgym.chat_conversion import ConversionError, chat_response_to_output, responses_to_chat_request
from rollgym.server import BadRequest

CONTEXT_ERROR_MARKERS = ("maximum context length", "context length", "context_length_exceeded", "too many tokens")


class ChatCompletionsConfig(ServerConfig):
    base_url: str = Field(description="the backend's OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the model name the backend serves")
    api_key: str | None = Field(default=None, description="sent as a bearer token; use ${oc.env:VAR}")
    timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    system_role: str = "system"
    return_token_ids: bool = Field(default=False, description="ask a vLLM backend for token ids and logprobs")
    parse_think_tags: bool = True
    extra_body: dict[str, Any] = Field(default_factory=dict, description="extra keys for every chat request")


class ChatCompletionsModel(ModelServer):
    config_class = ChatCompletionsConfig
    config: ChatCompletionsConfig

    def model_names(self) -> list[str]:
        return [self.config.model]

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            chat_request = responses_to_chat_request(payload, model=self.config.model, system_role=self.config.system_role)
        except ConversionError as exc:
            raise BadRequest(str(exc), field=exc.field) from None
        chat_request.update(self.config.extra_body)
        if self.config.return_token_ids:
            chat_request.update(logprobs=True, return_tokens_as_token_ids=True, return_token_ids=True)
        chat = await self._backend(chat_request)
        if chat is None:
            return build_response(payload, [], model=self.config.model, status="incomplete",
                                  incomplete_details={"reason": "max_output_tokens"})
        converted = chat_response_to_output(chat, parse_think_tags=self.config.parse_think_tags)
        tokens = token_triple(chat)
        if tokens is not None and converted.output:
            converted.output[-1].update(tokens)
        return build_response(payload, converted.output, model=self.config.model, usage=converted.usage,
                              status=converted.status, incomplete_details=converted.incomplete_details)

    async def chat_completions(self, payload: dict[str, Any]) -> dict[str, Any]:
        result = await self._backend({**payload, "model": payload.get("model") or self.config.model})
        if result is None:
            raise BadRequest("the prompt does not fit the model's context length", field="messages")
        return result

    async def _backend(self, chat_request: dict[str, Any]) -> dict[str, Any] | None:
        """The backend's chat completion; None when the prompt exceeds the context length."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        try:
            reply = await self.client.post(
                self.config.base_url.rstrip("/"), "/chat/completions", json=chat_request, headers=headers,
                timeout_s=self.config.timeout_s, max_retries=self.config.max_retries,
            )
        except ServerCallError as exc:
            raise HTTPException(504 if exc.kind == "timeout" else 502, detail=f"backend: {exc}") from None
        if reply.status == 400 and any(m in reply.error_message().lower() for m in CONTEXT_ERROR_MARKERS):
            return None
        if not reply.ok:
            status = reply.status if 400 <= reply.status < 500 else 502
            raise HTTPException(status, detail=f"backend answered HTTP {reply.status}: {reply.error_message()}")
        return reply.json()


def token_triple(chat: dict[str, Any]) -> dict[str, Any] | None:
    """Prompt ids, generated ids and their logprobs from a vLLM chat completion, if it has them.

    vLLM returns `prompt_token_ids` at the top level and `token_ids` on the choice when asked with
    `return_token_ids`; logprobs come per generated token in `choices[0].logprobs.content`.
    """
    choice = (chat.get("choices") or [{}])[0]
    prompt_ids = chat.get("prompt_token_ids") or choice.get("prompt_token_ids")
    generated = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if prompt_ids is None or content is None:
        return None
    if generated is None:
        # Older vLLM: ids only inside the `token_id:<id>` strings of return_tokens_as_token_ids.
        tokens = [str(entry.get("token", "")) for entry in content]
        if not all(token.startswith("token_id:") and token[9:].isdigit() for token in tokens):
            return None  # the backend sent token text, not ids: no exact token record
        generated = [int(token[9:]) for token in tokens]
    logprobs = [float(entry["logprob"]) for entry in content]
    if len(logprobs) != len(generated):
        return None
    return {"prompt_token_ids": list(prompt_ids), "generation_token_ids": list(generated),
            "generation_log_probs": logprobs}
