"""The model servers that hold their weights in this process (models/llamacpp, models/transformers).

`LocalModelServer` is what they share: `/v1/responses` and `/v1/chat/completions` around one
generated `Turn`, `/tokenize`, `/detokenize`, `/v1/score`, the logprobs mode of the sampling record,
and the worker queue's shutdown. A subclass loads its engine in `startup` (setting `model_name`,
`engine` with `n_vocab` and `n_ctx`, and `queue` with `run(call)` and `close(timeout)`) and writes the
engine-specific steps: `generate` (a chat request to a `Turn` on its worker), `score_logprobs`,
`tokenize_text`, `render_ids` and `detokenize`.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from fastapi import FastAPI, Request

from .adapters import Adapter
from .chat_conversion import ConversionError, responses_to_chat_request
from .errors import ContextLengthError
from .model import ModelServer, build_response
from .schema import ResponsesCreateParams
from .scoring import ScoreRequest, check_vocabulary, score_answer
from .sequences import previous_turn
from .server import BadRequest, JSONBytesResponse, read_json

__all__ = ["ContextLengthError", "LocalModelServer", "Turn", "chat_completion", "deliver", "output_items"]


@dataclass
class Turn:
    """One generated assistant turn: its text and tool calls, and the token record trainers need."""

    text: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str  # stop | length | tool_calls | abort
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    cached_tokens: int = 0
    generation_forced: list[int] | None = None  # 1: forced, not sampled
    generation_constrained: list[int] | None = None  # 1: sampled under a grammar
    # The weights that sampled it, when they can change while a request waits (a full-weight reload): else the
    # version the request found on arrival.
    model_version: str | None = None

    def usage(self) -> dict[str, Any]:
        return {"input_tokens": len(self.prompt_token_ids), "output_tokens": len(self.generation_token_ids),
                "input_tokens_details": {"cached_tokens": self.cached_tokens}}


class LocalModelServer(ModelServer):
    """Base of the in-process model servers: the routes and the Responses skeleton around a `Turn`."""

    config: Any  # a ServerConfig with `logprobs_mode: processed | raw`
    engine: Any
    queue: Any
    model_name: str

    # ------------------------------------------------------------------ what a subclass writes

    async def generate(self, chat: dict[str, Any], previous: Any, adapter: Adapter | None, *,
                       responses: bool) -> Turn:
        """One turn for a chat request (`previous`: the echoed previous turn, see `rollgym.sequences`);
        ContextLengthError when the prompt leaves no room, BadRequest for a bad field."""
        raise NotImplementedError

    def score_logprobs(self, request: ScoreRequest, adapter: Adapter | None) -> list[float]:
        """On the worker thread: log softmax(logits / T) of each completion token under the adapter's weights."""
        raise NotImplementedError

    def tokenize_text(self, text: str) -> list[int]:
        raise NotImplementedError

    def render_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                   add_generation_prompt: bool) -> list[int]:
        """Token ids of a conversation through the served chat template."""
        raise NotImplementedError

    def detokenize(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    # ------------------------------------------------------------------ shared

    async def shutdown(self) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            await asyncio.to_thread(queue.close, 5.0)

    def model_names(self) -> list[str]:
        return [getattr(self, "model_name", self.name)]

    def served_model(self, adapter: Adapter | None) -> str:
        return adapter.name if adapter is not None else self.model_name

    def _logprobs_mode(self, chat: dict[str, Any]) -> str:
        """Greedy decoding has no sampled distribution: its logprobs stay raw."""
        greedy = chat.get("temperature") is not None and float(chat["temperature"]) <= 0
        return "raw" if greedy else self.config.logprobs_mode

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        adapter, policy = self.serving_for(payload)
        model, version = self.served_model(adapter), self.version_of(adapter)
        try:
            chat = responses_to_chat_request(payload)
            previous = previous_turn(payload)
            # Not a Responses field, but the sampling record states it: a server that applies it reads it here.
            chat["top_k"] = payload.get("top_k")
        except ConversionError as exc:
            raise BadRequest(str(exc), field=exc.field) from None
        try:
            turn = await self.generate(chat, previous, adapter, responses=True)
        except ContextLengthError:
            return build_response(payload, [], model=model, status="incomplete",
                                  incomplete_details={"reason": "max_output_tokens"}, model_version=version,
                                  policy=policy)
        incomplete = turn.finish_reason == "length"
        return build_response(payload, output_items(turn), model=model, usage=turn.usage(),
                              status="incomplete" if incomplete else "completed",
                              incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                              model_version=turn.model_version or version, logprobs_mode=self._logprobs_mode(chat),
                              policy=policy)

    async def chat_completions(self, payload: dict[str, Any]) -> dict[str, Any]:
        adapter, policy = self.serving_for(payload)
        try:
            turn = await self.generate(payload, None, adapter, responses=False)
        except ContextLengthError as exc:
            raise BadRequest(str(exc), field="messages") from None
        answer = chat_completion(turn, self.served_model(adapter), with_logprobs=bool(payload.get("logprobs")))
        answer["model_version"] = turn.model_version or self.version_of(adapter)
        if policy is not None:
            answer["policy"] = policy
        return answer

    async def score(self, request: ScoreRequest, adapter: Adapter | None) -> dict[str, Any]:
        """Teacher-forced logprobs of the completion tokens, queued on the worker like a generation."""
        check_vocabulary(request, self.engine.n_vocab, self.name)
        try:
            logprobs = await self.queue.run(lambda: self.score_logprobs(request, adapter))
        except ContextLengthError as exc:
            raise BadRequest(str(exc), field="completion_token_ids") from None
        return score_answer(request, logprobs, model=self.served_model(adapter),
                            version=self.version_of(adapter), vocab_size=self.engine.n_vocab)

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONBytesResponse:
            """{"text": str} or {"input": Responses input, "tools", "instructions", "add_generation_prompt"}."""
            payload = await read_json(request)
            if isinstance(payload, dict) and isinstance(payload.get("text"), str):
                ids = self.tokenize_text(payload["text"])
                return JSONBytesResponse({"tokens": ids, "count": len(ids)})
            if not isinstance(payload, dict) or payload.get("input") is None:
                raise BadRequest("required: 'text' (a string) or 'input' (Responses input items)", field="text")
            try:
                chat = responses_to_chat_request({key: payload.get(key) for key in ("input", "instructions", "tools")})
            except ConversionError as exc:
                raise BadRequest(str(exc), field=exc.field) from None
            ids = self.render_ids(chat["messages"], chat.get("tools"),
                                  add_generation_prompt=payload.get("add_generation_prompt", True) is not False)
            return JSONBytesResponse({"tokens": ids, "count": len(ids)})

        @app.post("/detokenize")
        async def detokenize(request: Request) -> JSONBytesResponse:
            """{"tokens": [int], "pieces": bool} -> {"text", "pieces"?}."""
            payload = await read_json(request)
            tokens = payload.get("tokens") if isinstance(payload, dict) else None
            n_vocab = self.engine.n_vocab
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < n_vocab for t in tokens):
                raise BadRequest(f"required: a list of token ids in [0, {n_vocab})", field="tokens")
            result: dict[str, Any] = {"text": self.detokenize(tokens)}
            if payload.get("pieces"):
                result["pieces"] = [self.detokenize([token]) for token in tokens]
            return JSONBytesResponse(result)


def output_items(turn: Turn) -> list[dict[str, Any]]:
    """Responses output items of one turn; the token record goes on the last one."""
    items: list[dict[str, Any]] = []
    if turn.text.strip():
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                      "status": "completed", "content": [{"type": "output_text", "text": turn.text, "annotations": []}]})
    for call in turn.tool_calls:
        items.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    if not items:
        # An empty generation (e.g. only an end-of-turn token) is still a turn with tokens.
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                      "status": "completed", "content": [{"type": "output_text", "text": "", "annotations": []}]})
    items[-1].update(prompt_token_ids=turn.prompt_token_ids, generation_token_ids=turn.generation_token_ids,
                     generation_log_probs=turn.generation_log_probs)
    if turn.generation_forced is not None:
        items[-1]["generation_forced"] = turn.generation_forced
    if turn.generation_constrained is not None:
        items[-1]["generation_constrained"] = turn.generation_constrained
    return items


def chat_completion(turn: Turn, model: str, *, with_logprobs: bool) -> dict[str, Any]:
    """A Chat Completions answer shaped like vLLM's, with token ids (and logprobs when asked)."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
    if turn.tool_calls:
        message["tool_calls"] = turn.tool_calls
    logprobs = None
    if with_logprobs:
        logprobs = {"content": [{"token": f"token_id:{token}", "logprob": logprob, "bytes": None, "top_logprobs": []}
                                for token, logprob in zip(turn.generation_token_ids, turn.generation_log_probs)]}
    prompt, completion = len(turn.prompt_token_ids), len(turn.generation_token_ids)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "prompt_token_ids": turn.prompt_token_ids,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": turn.finish_reason,
                     "token_ids": turn.generation_token_ids}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }


def deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], outcome: Any) -> None:
    """From a model server's worker thread: complete `future` on its event loop with `outcome` (an exception is
    raised to the awaiting request), unless it was cancelled meanwhile or the loop is gone."""

    def complete() -> None:
        if future.done():
            return
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    with contextlib.suppress(RuntimeError):  # the event loop is closed: nobody waits any more
        loop.call_soon_threadsafe(complete)
