"""Server-Sent Events for the OpenAI-compatible routes, shaped as the `openai` SDK parses them.

`POST /v1/responses` with `stream: true` answers the Responses event sequence (`response.created`,
`response.output_item.added`, `response.output_text.delta`, ..., `response.completed`);
`POST /v1/chat/completions` with `stream: true` answers `chat.completion.chunk`s and `data: [DONE]`.
Both are built from a finished answer: a model server (or the proxy agent) generates as usual and
this module replays the result as events, so every server streams the same way and the token
fields stay on the final items (`response.output_item.done`, `response.completed`, the last chunk).
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Iterable, Iterator

import orjson
from starlette.responses import StreamingResponse

from .schema import TOKEN_FIELDS

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Item fields that appear only once an item is done (the SDK fills the rest from the deltas).
_FINAL_ONLY = (*TOKEN_FIELDS, "model_version")


def _shell(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as `response.output_item.added` announces it: in progress, no content yet."""
    shell = {key: value for key, value in item.items() if key not in _FINAL_ONLY}
    shell["status"] = "in_progress"
    kind = item.get("type")
    if kind == "message":
        shell["content"] = []
    elif kind == "function_call":
        shell["arguments"] = ""
    elif kind == "reasoning":
        shell["summary"] = []
        shell.pop("status")
        shell.pop("content", None)
    return shell


def _item_events(index: int, item: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events that stream one finished output item."""
    item_id = item.get("id") or f"item_{index}"
    item = {**item, "id": item_id}
    yield {"type": "response.output_item.added", "output_index": index, "item": _shell(item)}
    kind = item.get("type")
    where = {"item_id": item_id, "output_index": index}
    if kind == "message":
        for part_index, part in enumerate(item.get("content") or []):
            at = {**where, "content_index": part_index}
            if part.get("type") == "output_text":
                yield {"type": "response.content_part.added", **at,
                       "part": {"type": "output_text", "text": "", "annotations": []}}
                if part.get("text"):
                    yield {"type": "response.output_text.delta", **at, "delta": part["text"], "logprobs": []}
                yield {"type": "response.output_text.done", **at, "text": part.get("text", ""), "logprobs": []}
            elif part.get("type") == "refusal":
                yield {"type": "response.content_part.added", **at, "part": {"type": "refusal", "refusal": ""}}
                yield {"type": "response.refusal.delta", **at, "delta": part.get("refusal", "")}
                yield {"type": "response.refusal.done", **at, "refusal": part.get("refusal", "")}
            else:
                yield {"type": "response.content_part.added", **at, "part": part}
            yield {"type": "response.content_part.done", **at, "part": part}
    elif kind == "function_call":
        arguments = item.get("arguments") or ""
        if arguments:
            yield {"type": "response.function_call_arguments.delta", **where, "delta": arguments}
        yield {"type": "response.function_call_arguments.done", **where, "name": item.get("name"),
               "arguments": arguments}
    elif kind == "reasoning":
        for summary_index, part in enumerate(item.get("summary") or []):
            at = {**where, "summary_index": summary_index}
            yield {"type": "response.reasoning_summary_part.added", **at, "part": {"type": "summary_text", "text": ""}}
            yield {"type": "response.reasoning_summary_text.delta", **at, "delta": part.get("text", "")}
            yield {"type": "response.reasoning_summary_text.done", **at, "text": part.get("text", "")}
            yield {"type": "response.reasoning_summary_part.done", **at, "part": part}
    yield {"type": "response.output_item.done", "output_index": index, "item": item}


def response_events(response: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The Responses stream of a finished response (a Response as JSON), with sequence numbers.

    The last event is `response.completed`, or `response.incomplete` / `response.failed` as the
    response's status says, carrying the whole response (token fields included).
    """
    started = {**response, "status": "in_progress", "output": [], "usage": None,
               "incomplete_details": None, "error": None}
    events: Iterable[dict[str, Any]] = [
        {"type": "response.created", "response": started},
        {"type": "response.in_progress", "response": started},
    ]
    output = response.get("output") or []
    output = [{**item, "id": item.get("id") or f"item_{i}"} for i, item in enumerate(output)]
    final = {**response, "output": output}
    status = response.get("status") or "completed"
    last = {"completed": "response.completed", "incomplete": "response.incomplete",
            "failed": "response.failed"}.get(status, "response.completed")
    sequence = 0
    for event in [*events, *(e for i, item in enumerate(output) for e in _item_events(i, item)),
                  {"type": last, "response": final}]:
        yield {**event, "sequence_number": sequence}
        sequence += 1


def chat_chunks(completion: dict[str, Any], *, include_usage: bool = False) -> Iterator[dict[str, Any]]:
    """The `chat.completion.chunk`s of a finished chat completion (first choice).

    Token fields, when the completion has them, go as the server sent them: `prompt_token_ids` on
    the first chunk, the choice's `token_ids` on the last one with a choice.
    """
    head = {"id": completion.get("id"), "object": "chat.completion.chunk", "created": completion.get("created"),
            "model": completion.get("model")}
    if completion.get("system_fingerprint") is not None:
        head["system_fingerprint"] = completion["system_fingerprint"]
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}

    def chunk(delta: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **extra}]}

    first = chunk({"role": "assistant", "content": ""})
    if completion.get("prompt_token_ids") is not None:
        first["prompt_token_ids"] = completion["prompt_token_ids"]
    yield first
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        yield chunk({"reasoning_content": reasoning})
    if message.get("content"):
        yield chunk({"content": message["content"]}, logprobs=choice.get("logprobs"))
    for index, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function") or {}
        yield chunk({"tool_calls": [{"index": index, "id": call.get("id"), "type": "function",
                                     "function": {"name": function.get("name"),
                                                  "arguments": function.get("arguments") or ""}}]})
    last = chunk({}, finish_reason=choice.get("finish_reason") or "stop")
    if choice.get("token_ids") is not None:
        last["choices"][0]["token_ids"] = choice["token_ids"]
    yield last
    if include_usage and completion.get("usage") is not None:
        yield {**head, "choices": [], "usage": completion["usage"]}


def encode_event(event: dict[str, Any]) -> bytes:
    """One Responses event as SSE (`event:` names its type, as OpenAI sends it)."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def encode_chunk(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def _aiter(parts: Iterable[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def sse_response(parts: Iterable[bytes]) -> StreamingResponse:
    return StreamingResponse(_aiter(parts), media_type="text/event-stream", headers=SSE_HEADERS)


def stream_response(response: dict[str, Any]) -> StreamingResponse:
    """A finished Response, streamed as the Responses API streams it."""
    return sse_response(encode_event(event) for event in response_events(response))


def stream_chat_completion(completion: dict[str, Any], *, include_usage: bool = False) -> StreamingResponse:
    """A finished chat completion, streamed as chunks ending with `data: [DONE]`."""
    parts = [encode_chunk(chunk) for chunk in chat_chunks(completion, include_usage=include_usage)]
    return sse_response([*parts, b"data: [DONE]\n\n"])


def wants_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
