"""The proxy's Chat Completions face: a chat request becomes a Responses request for the model
server, and the Response comes back as a chat completion (the kernel's conversions, reversed)."""

from __future__ import annotations

from typing import Any

from rollgym.chat_conversion import (
    ConversionError,
    chat_messages_to_responses_input,
    chat_tool_choice_to_responses,
    chat_tools_to_responses_tools,
)
from rollgym.server import BadRequest
from rollgym.text import message_text

# Sampling keys that mean the same in both APIs.
SHARED_KEYS = ("model", "temperature", "top_p", "seed", "stop", "parallel_tool_calls", "metadata")


def chat_to_responses(body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion request → the Responses request the model server gets (BadRequest naming
    the field for what cannot be converted)."""
    if body.get("n") not in (None, 1):
        raise BadRequest("only n=1 is served; send several requests for several samples", field="n")
    try:
        params: dict[str, Any] = {"input": chat_messages_to_responses_input(body["messages"])}
        if body.get("tools"):
            params["tools"] = chat_tools_to_responses_tools(body["tools"])
        if body.get("tool_choice") is not None:
            params["tool_choice"] = chat_tool_choice_to_responses(body["tool_choice"])
    except ConversionError as exc:
        raise BadRequest(str(exc), field=exc.field) from None
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None:
        params["max_output_tokens"] = max_tokens
    params.update({key: body[key] for key in SHARED_KEYS if body.get(key) is not None})
    return params


def response_to_chat(response: dict[str, Any], *, token_ids: bool = False, logprobs: bool = False) -> dict[str, Any]:
    """A Response → the chat completion an OpenAI client expects (choice 0), optionally with the
    token ids (vLLM's `prompt_token_ids` / `choices[0].token_ids`) and `token_id:N` logprobs."""
    text_parts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    record: dict[str, Any] | None = None
    for item in response.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            text_parts.append(message_text(item))
        elif kind == "function_call":
            tool_calls.append({"id": item.get("call_id"), "type": "function",
                               "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}})
        elif kind == "reasoning":
            reasoning.extend(str(part.get("text", "")) for part in item.get("summary") or [])
        if item.get("generation_token_ids") is not None:
            record = item
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text_parts) or None}
    if tool_calls:
        message["tool_calls"] = tool_calls
    if reasoning:
        message["reasoning_content"] = "\n\n".join(reasoning)
    if response.get("status") == "incomplete":
        finish = "length"
    else:
        finish = "tool_calls" if tool_calls else "stop"
    choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    completion: dict[str, Any] = {
        "id": "chatcmpl-" + str(response.get("id", "")).removeprefix("resp_"),
        "object": "chat.completion",
        "created": int(response.get("created_at") or 0),
        "model": response.get("model"),
        "choices": [choice],
        "usage": _usage(response.get("usage") or {}),
    }
    if record is not None and logprobs:
        choice["logprobs"] = {"content": [
            {"token": f"token_id:{token}", "logprob": value, "bytes": None, "top_logprobs": []}
            for token, value in zip(record["generation_token_ids"], record["generation_log_probs"])]}
    if record is not None and token_ids:
        completion["prompt_token_ids"] = record["prompt_token_ids"]
        choice["token_ids"] = record["generation_token_ids"]
    return completion


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    prompt = int(usage.get("input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
