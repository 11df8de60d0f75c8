"""chat_completions: a Responses API model server in front of OpenAI-compatible inference backends
(vLLM, SGLang, OpenAI, llama.cpp server...), with token-exact training data for vLLM and SGLang.

Responses requests are converted to chat requests and the chat answers back to Responses output
items by `rollgym.chat_conversion`. With `return_token_ids: true` the backend is asked for the
prompt ids, generated ids and sampling logprobs (vLLM: `logprobs`, `return_tokens_as_token_ids`,
`return_token_ids`; SGLang: `logprobs`, `return_prompt_token_ids`, `return_token_ids`), which go
on the last item the call generated. When the input carries a previous turn's token record, the
next prompt is built to extend `prompt_token_ids + generation_token_ids` exactly: the new
conversation is tokenized with the backend's `/tokenize`, the tokens the new messages add are
appended to the previous tokens (`rollgym.sequences.extend_tokens`), and the token-id prompt goes
to vLLM's `/v1/completions` (the raw text is then parsed here: `parsers.py`) or to SGLang's chat
endpoint as `input_ids`. A backend that cannot do this gets a plain chat request, and any drift
shows as `prefix_ok: false`. Several `base_url`s are routed with sticky sessions (`routing.py`).
See README.md.
"""

from __future__ import annotations

import asyncio
import random
import secrets
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Literal

from fastapi import FastAPI, HTTPException, Request
from pydantic import Field, ValidationInfo, field_validator, model_validator

from rollgym import ModelServer, ResponsesCreateParams, ServerCallError, ServerConfig, build_response
from rollgym.adapters import Adapter, LoadLoraAdapterRequest
from rollgym.chat_conversion import ConversionError, chat_response_to_output, responses_to_chat_request
from rollgym.client import Reply
from rollgym.model import stamp_sampling
from rollgym.sampling_contract import BACKEND_NEUTRAL, RESHAPING, record as sampling_record
from rollgym.scoring import ScoreRequest, score_answer
from rollgym.sequences import TokenRecord, extend_tokens, previous_turn
from rollgym.server import BadRequest, JSONBytesResponse, read_json

from .adapters import backend_model, load_everywhere, unload_everywhere
from .continuation import (ABORTED, MAX_CONTINUATIONS, Segment, continuation_body, joined_text, wait_until_resumed,
                           was_aborted)
from .parsers import REASONING_PARSERS, TOOL_PARSERS, load_parser, parse_generation
from .routing import Backend, BackendPool, BackendUnavailable
from .weights import WeightsGate, pool_version, update_weights_everywhere

CONTEXT_ERROR_MARKERS = (
    "maximum context length", "context length", "context_length_exceeded", "too many tokens",
    "is too long", "longer than the model", "exceeds the model",
)
BACKEND_FAILURE_STATUSES = frozenset({500, 502, 503, 504})


class ChatCompletionsConfig(ServerConfig):
    base_url: str | list[str] = Field(
        description="the backend's OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1), or a list of them")
    model: str = Field(description="the model name the backend serves")
    backend: Literal["vllm", "sglang", "openai"] = Field(
        default="vllm", description="which backend's extra fields to send; openai: none (its API rejects them)")
    api_key: str | None = Field(default=None, description="sent as a bearer token; use ${oc.env:VAR}")
    timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    system_role: str = "system"
    return_token_ids: bool = Field(default=False, description="ask the backend for token ids and logprobs")
    token_prompts: bool = Field(
        default=True, description="extend the previous turn's tokens with a token-id prompt (vLLM, SGLang)")
    tool_parser: str = Field(default="hermes", description="parser of raw generations: hermes | llama3_json | "
                             "mistral | qwen3_coder | deepseek_v3 | glm45 | harmony | none | module:function")
    reasoning_parser: str = Field(default="think", description="think | deepseek_r1 | harmony | none | module:function")
    parse_think_tags: bool = True
    reasoning_field: Literal["auto", "reasoning_content", "reasoning", "think_tags", "drop"] = Field(
        default="auto", description="how reasoning goes back to the backend; auto: reasoning_content, openai: drop")
    default_max_output_tokens: int | None = Field(
        default=None, ge=1, description="max_tokens of token-id completions when the request gives none (null: the rest of the context)")
    model_version: str | None = Field(default=None, description="reported on every generated item (else the backend's)")
    logprobs_mode: Literal["raw", "processed"] = Field(
        default="raw", description="which logprobs the backend returns, recorded on every item: vLLM's --logprobs-mode "
                                   "raw_logprobs (its default: before temperature and top-p) or processed_logprobs")
    backend_cooldown_s: float = Field(default=10.0, gt=0, description="how long a failed backend gets no traffic")
    weights_check_s: float = Field(default=10.0, ge=0, description="once full weights were reloaded (vLLM): how "
                                   "often a backend is asked which weights it serves (a restarted one is reloaded)")
    continue_aborted: bool = Field(
        default=False, description="in-flight weight updates: a generation the backend aborts (vLLM's /pause?mode="
        "abort) is continued from its partial tokens once the backend is resumed, on the new weights (continuation.py)")
    resume_wait_s: float = Field(default=300.0, gt=0, description="how long an aborted generation waits for the "
                                 "backend's /resume before it fails (continue_aborted)")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="extra keys for every backend request")

    @field_validator("base_url")
    @classmethod
    def _urls(cls, value: str | list[str]) -> str | list[str]:
        urls = [value] if isinstance(value, str) else list(value)
        if not urls or not all(isinstance(url, str) and url.startswith(("http://", "https://")) for url in urls):
            raise ValueError("must be an http(s) URL or a non-empty list of them")
        return value

    @model_validator(mode="after")
    def _parsers(self) -> "ChatCompletionsConfig":
        load_parser(self.tool_parser, TOOL_PARSERS)
        load_parser(self.reasoning_parser, REASONING_PARSERS)
        return self

    @field_validator("continue_aborted")
    @classmethod
    def _continuation(cls, value: bool, info: ValidationInfo) -> bool:
        if value and (info.data.get("backend") != "vllm" or not info.data.get("return_token_ids")):
            raise ValueError("continues a generation from its partial tokens: it needs backend: vllm and "
                             "return_token_ids: true")
        return value

    @property
    def base_urls(self) -> list[str]:
        return [self.base_url] if isinstance(self.base_url, str) else list(self.base_url)


# The sampling settings a token backend is always sent, at their neutral values when neither the request nor
# extra_body gives one: the sampling contract's BACKEND_NEUTRAL.
def applied_sampling(request: dict[str, Any], logprobs_mode: str) -> dict[str, Any]:
    """The sampling record of what the backend was sent (extra_body included, after pinning): temperature,
    top_p, top_k (0: off) and the logprobs mode, plus min_p, the penalties and min_tokens wherever not neutral."""
    return sampling_record(request, logprobs_mode, applied=tuple(RESHAPING))


@dataclass
class Turn:
    """One generated turn, in Responses terms."""

    output: list[dict[str, Any]]
    status: str = "completed"
    incomplete_details: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None
    tokens: dict[str, Any] | None = None
    model_version: str | None = None
    # A generation continued after aborts (continuation.py): (raw version, tokens) per segment, in order.
    version_spans: list[tuple[str | None, int]] | None = None


def context_length_turn() -> Turn:
    """A prompt that does not fit: `status: incomplete` (finish_reason length), not a server error."""
    return Turn(output=[], status="incomplete", incomplete_details={"reason": "max_output_tokens"})


class ChatCompletionsModel(ModelServer):
    config_class = ChatCompletionsConfig
    config: ChatCompletionsConfig
    applies = frozenset({"min_tokens", "repetition_penalty"})  # the backends (vLLM, SGLang) sample under them

    def __init__(self, config: ChatCompletionsConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.pool = BackendPool(self.config.base_urls, cooldown_s=self.config.backend_cooldown_s)
        self.weights = WeightsGate()  # the full weights the backends were last asked to serve (weights.py)
        self.tool_parser = load_parser(self.config.tool_parser, TOOL_PARSERS)
        self.reasoning_parser = load_parser(self.config.reasoning_parser, REASONING_PARSERS)
        # Raw completions parsed here (the token-prompt path), and the tool calls left as text (GET /backends).
        self.parsing = {"tool_parser": self.config.tool_parser, "generations": 0, "failures": 0}

    def model_names(self) -> list[str]:
        return [self.config.model]

    def version_of(self, adapter: Adapter | None) -> str:
        """An adapter's version; for the base, the full weights every backend serves (POST
        /update_weights_from_disk), else the configured `model_version` or the model's name."""
        if adapter is not None:
            return adapter.version
        return pool_version(self) or self.config.model_version or self.config.model

    def served_model(self, adapter: Adapter | None) -> str:
        """The `model` the backends expect for requests served by `adapter` (None: the base)."""
        return backend_model(self.config.backend, self.config.model, adapter.name) if adapter else self.config.model

    async def attach_adapter(self, request: LoadLoraAdapterRequest) -> Any:
        return await load_everywhere(self, request)

    async def detach_adapter(self, adapter: Adapter) -> dict[str, Any] | None:
        if adapter.name in self.adapters:
            return None  # replaced in place: the backends already serve the new weights under this name
        return {"backends": await unload_everywhere(self, adapter.name)}

    def adapter_details(self, adapter: Adapter) -> dict[str, Any]:
        return {"backends": adapter.handle}

    async def score(self, request: ScoreRequest, adapter: Adapter | None) -> dict[str, Any]:
        """The backend's prompt logprobs of `prompt + completion` (vLLM: /v1/completions with `prompt_logprobs`;
        SGLang: /generate with `return_logprob` from the first completion token), its completion part."""
        if self.config.backend == "openai":
            raise BadRequest("an OpenAI backend cannot score given tokens (no prompt logprobs)", status=404)
        if request.temperature != 1.0:
            raise BadRequest("the backends' prompt logprobs are the model's own (temperature 1)", field="temperature")
        start, ids, model = len(request.prompt_token_ids), request.all_ids, self.served_model(adapter)

        async def call(backend: Backend) -> list[float]:
            if self.config.backend == "sglang":
                reply = await self._post(backend, "/generate", {
                    "input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                    "return_logprob": True, "logprob_start_len": start - 1, "lora_path": adapter.name if adapter
                    else None}, root=True)
                _raise_for_status(reply)
                rows = (reply.json().get("meta_info") or {}).get("input_token_logprobs") or []
                return [row[0] for row in rows[-len(request.completion_token_ids):]]
            reply = await self._post(backend, "/completions", {"model": model, "prompt": ids, "max_tokens": 1,
                                                               "prompt_logprobs": 0, "temperature": 1.0})
            if reply.status in (404, 405):
                raise BadRequest("the backend has no /v1/completions, so no prompt_logprobs: it cannot score given "
                                 "tokens", status=404)
            _raise_for_status(reply)
            rows = ((reply.json().get("choices") or [{}])[0].get("prompt_logprobs") or [])[start:]
            return [(row or {}).get(str(token), {}).get("logprob") for row, token in zip(rows, ids[start:])]

        logprobs, _ = await self._routed(call)
        if len(logprobs) != len(request.completion_token_ids) or any(not isinstance(x, (int, float)) for x in logprobs):
            raise HTTPException(502, detail=f"backend: no prompt logprob for each of the {len(request.completion_token_ids)}"
                                            " completion tokens (vLLM: prompt_logprobs; SGLang: input_token_logprobs)")
        return score_answer(request, logprobs, model=adapter.name if adapter else self.config.model,
                            version=self.version_of(adapter), vocab_size=None)

    @property
    def wants_tokens(self) -> bool:
        return self.config.return_token_ids and self.config.backend != "openai"

    # ------------------------------------------------------------------ Responses API

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        adapter = self.adapter_for(payload)
        try:
            chat_request = responses_to_chat_request(payload, model=self.served_model(adapter),
                                                     system_role=self.config.system_role)
            previous = previous_turn(payload, system_role=self.config.system_role) if self.wants_tokens else None
        except ConversionError as exc:
            raise BadRequest(str(exc), field=exc.field) from None
        self._adapt_messages(chat_request["messages"])
        if previous is not None:
            self._adapt_messages(previous[1])
        chat_request.update(self.config.extra_body)
        if self.wants_tokens:
            for key, neutral in BACKEND_NEUTRAL.items():
                if chat_request.get(key) is None:
                    chat_request[key] = neutral

        async def generate(backend: Backend) -> Turn:
            weights = backend.weight_version  # read at dispatch: a reload waits for this generation (weights.py)
            turn = await self._generate(backend, payload, chat_request, previous)
            if weights is not None and turn.version_spans is None:  # a continued turn's is its last token's
                turn.model_version = weights
            return turn

        turn, backend = await self._routed(generate, sticky=self.pool.sticky_backend(payload.get("input")))
        output = turn.output
        if turn.tokens is not None and not output:
            # An empty generation (e.g. only the end-of-turn token) is still a turn with tokens.
            output = [{"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                       "status": "completed", "content": [{"type": "output_text", "text": "", "annotations": []}]}]
        # An adapter's version is this server's (name@load number); the base's is configured or the backend's.
        version = self.version_of(adapter) if adapter else (turn.model_version or self.config.model)
        for item in output:
            if isinstance(item.get("id"), str):
                item["id"] = self.pool.tag_item_id(item["id"], backend)
        if turn.tokens is not None:
            output[-1].update(turn.tokens)
            if turn.version_spans is not None:  # continued after aborts: which weights sampled which tokens
                output[-1]["model_version_spans"] = [
                    {"model_version": self.version_of(adapter) if adapter else (raw or self.config.model),
                     "tokens": count} for raw, count in turn.version_spans]
            # What the backend applied, not what the client asked for (build_response's record keeps this one).
            stamp_sampling(output, applied_sampling(chat_request, self.config.logprobs_mode))
        return build_response(payload, output, model=adapter.name if adapter else self.config.model, usage=turn.usage,
                              status=turn.status, incomplete_details=turn.incomplete_details, model_version=version,
                              logprobs_mode=self.config.logprobs_mode)

    async def _generate(self, backend: Backend, payload: dict[str, Any], chat_request: dict[str, Any],
                        previous: tuple[TokenRecord, list[dict[str, Any]]] | None) -> Turn:
        """One turn on `backend`: a token-id prompt extending the previous turn when possible, else chat."""
        if previous is not None and self.config.token_prompts and self.config.backend in ("vllm", "sglang") \
                and _tool_choice_is_free(chat_request.get("tool_choice")):
            prompt_ids = await self._extended_prompt(backend, chat_request, previous)
            if prompt_ids is not None:
                if self.config.backend == "vllm":
                    turn = await self._complete_tokens(backend, chat_request, prompt_ids)
                    if turn is not None:
                        return turn
                else:
                    return await self._chat(backend, chat_request, input_ids=prompt_ids)
        return await self._chat(backend, chat_request)

    async def _chat(self, backend: Backend, chat_request: dict[str, Any], input_ids: list[int] | None = None,
                    restarts: int = 0) -> Turn:
        body = dict(chat_request)
        if self.config.backend == "openai" and "max_tokens" in body:
            body["max_completion_tokens"] = body.pop("max_tokens")  # OpenAI's name; o-series reject max_tokens
        if self.wants_tokens:
            if self.config.backend == "vllm":
                body.update(logprobs=True, return_tokens_as_token_ids=True, return_token_ids=True)
            else:
                body.update(logprobs=True, return_prompt_token_ids=True, return_token_ids=True, return_meta_info=True)
        if input_ids is not None:
            body["input_ids"] = input_ids
        dispatched = self._version_now(backend)
        reply = await self._post(backend, "/chat/completions", body)
        if is_context_error(reply):
            return context_length_turn()
        _raise_for_status(reply)
        chat = reply.json()
        if was_aborted((chat.get("choices") or [{}])[0]):
            return await self._chat_aborted(backend, chat_request, chat, input_ids, restarts,
                                            dispatched or backend_model_version(chat))
        try:
            converted = chat_response_to_output(chat, parse_think_tags=self.config.parse_think_tags)
        except ConversionError as exc:
            raise HTTPException(502, detail=f"backend sent an unusable answer: {exc}") from None
        tokens = None
        if self.wants_tokens:
            tokens = token_triple(chat)
            if tokens is None and input_ids is not None:
                tokens = token_triple(chat, prompt_ids=input_ids)
            if tokens is None and generated_ids(chat) is not None:
                # The backend gave generated ids but no prompt ids: its /tokenize renders the prompt.
                prompt = await self._tokenize_chat(backend, chat_request["messages"], chat_request.get("tools"), True)
                if prompt is not None:
                    tokens = token_triple(chat, prompt_ids=prompt)
        if tokens is not None and constrains_output(chat_request):
            forced = [int(logprob == 0.0) for logprob in tokens["generation_log_probs"]]
            if any(forced):
                tokens["generation_forced"] = forced
            tokens["generation_constrained"] = [1] * len(tokens["generation_log_probs"])
        return Turn(converted.output, converted.status, converted.incomplete_details, converted.usage, tokens,
                    dispatched or backend_model_version(chat))

    async def _chat_aborted(self, backend: Backend, chat_request: dict[str, Any], chat: dict[str, Any],
                            input_ids: list[int] | None, restarts: int, version: str | None) -> Turn:
        """An aborted chat generation: continued from its tokens on /v1/completions (its text parsed here), or,
        when a grammar shaped it (a completions prompt cannot carry that on), generated anew once resumed."""
        tokens = token_triple(chat, prompt_ids=input_ids) if self.wants_tokens else None
        if self.config.continue_aborted and tokens is not None and constrains_output(chat_request):
            if restarts >= MAX_CONTINUATIONS:
                raise HTTPException(502, detail=f"backend aborted the generation {restarts + 1} times")
            await self.weights.admit(self, backend)
            await wait_until_resumed(lambda: self._is_paused(backend), self.config.resume_wait_s,
                                     len(tokens["generation_token_ids"]))
            turn = await self._chat(backend, chat_request, input_ids, restarts + 1)
            if turn.tokens is not None and turn.version_spans is None:  # generated anew: all the new version's
                turn.version_spans = [(turn.model_version, len(turn.tokens["generation_token_ids"]))]
            return turn
        prompt_ids = tokens["prompt_token_ids"] if tokens is not None else []
        return await self._continue(backend, chat_request, self._completion_body(chat_request, prompt_ids), prompt_ids,
                                    tokens, version)

    async def _complete_tokens(self, backend: Backend, chat_request: dict[str, Any], prompt_ids: list[int]) -> Turn | None:
        """vLLM: generate from a token-id prompt on /v1/completions and parse the raw text here."""
        if backend.capabilities.get("completions") is False:
            return None
        body = self._completion_body(chat_request, prompt_ids)
        dispatched = self._version_now(backend)
        reply = await self._post(backend, "/completions", body)
        if reply.status in (404, 405):
            backend.capabilities["completions"] = False
            return None
        if is_context_error(reply):
            return context_length_turn()
        _raise_for_status(reply)
        completion = reply.json()
        choice = (completion.get("choices") or [{}])[0]
        tokens = completion_triple(choice, prompt_ids)
        version = dispatched or backend_model_version(completion)
        if was_aborted(choice):
            return await self._continue(backend, chat_request, body, prompt_ids, tokens, version)
        return self._text_turn(chat_request, choice.get("text") or "", choice.get("finish_reason"),
                               completion.get("usage"), tokens, version)

    def _completion_body(self, chat_request: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any]:
        """The /v1/completions body of a token-id prompt, with the request's sampling settings."""
        max_tokens = chat_request.get("max_tokens", self.config.default_max_output_tokens)
        body: dict[str, Any] = {"model": chat_request.get("model", self.config.model), "prompt": prompt_ids,
                                "max_tokens": max_tokens,
                                "logprobs": 0, "return_token_ids": True, "return_tokens_as_token_ids": True}
        for key in (*BACKEND_NEUTRAL, "seed", "stop"):
            if chat_request.get(key) is not None:
                body[key] = chat_request[key]
        body.update(self.config.extra_body)
        return body

    def _text_turn(self, chat_request: dict[str, Any], text: str, finish_reason: Any, usage: Any,
                   tokens: dict[str, Any] | None, version: str | None,
                   spans: list[tuple[str | None, int]] | None = None) -> Turn:
        """A raw completion's text parsed here into reasoning, message and tool calls."""
        # tool_choice "none" cannot reach a completions prompt: a call the model writes anyway stays text.
        tools_offered = bool(chat_request.get("tools")) and chat_request.get("tool_choice") != "none"
        message = parse_generation(text, tools_offered=tools_offered,
                                   tool_parser=self.tool_parser, reasoning_parser=self.reasoning_parser)
        self.parsing["generations"] += 1
        self.parsing["failures"] += message.pop("parse_failures")
        chat_like = {"choices": [{"message": message, "finish_reason": finish_reason}], "usage": usage}
        converted = chat_response_to_output(chat_like, parse_think_tags=False)
        return Turn(converted.output, converted.status, converted.incomplete_details, converted.usage, tokens,
                    version, spans)

    def _version_now(self, backend: Backend) -> str | None:
        """The version of the weights that serve a request sent to `backend` now, as this server knows it: the
        full weights it was last given (weights.py: a reload holds requests until it has its version), else the
        configured one; None: the backend's own (`weight_version` in its answer). Read at dispatch, so that a
        generation aborted by a reload keeps the version it began on and its continuation gets the new one."""
        return backend.weight_version or self.config.model_version

    # ------------------------------------------------------------------ in-flight weight updates

    async def _continue(self, backend: Backend, chat_request: dict[str, Any], body: dict[str, Any],
                        prompt_ids: list[int], tokens: dict[str, Any] | None, version: str | None) -> Turn:
        """A generation the backend aborted, continued from its tokens after each resume until it ends
        (continuation.py): one Turn with all its tokens and a version span per segment."""
        if not self.config.continue_aborted:
            raise HTTPException(502, detail="backend aborted the generation (finish_reason abort: a weight update or "
                                            "/abort_requests); continue_aborted: true continues such generations")
        if tokens is None:
            raise HTTPException(502, detail="backend aborted the generation without its token ids and logprobs, so "
                                            "it cannot be continued")
        segments = [Segment(tokens["generation_token_ids"], tokens["generation_log_probs"], version)]
        choice: dict[str, Any] = {"finish_reason": ABORTED}
        for _ in range(MAX_CONTINUATIONS):
            generated = [token for segment in segments for token in segment.token_ids]
            await self.weights.admit(self, backend)  # a reload through this server: until it has its version
            await wait_until_resumed(lambda: self._is_paused(backend), self.config.resume_wait_s, len(generated))
            rest = continuation_body(body, prompt_ids, generated)
            if rest is None:  # aborted on its last token
                choice = {"finish_reason": "length"}
                break
            dispatched = self._version_now(backend)
            reply = await self._post(backend, "/completions", rest)
            if is_context_error(reply):  # the context is full: the generation ends there, cut off
                choice = {"finish_reason": "length"}
                break
            _raise_for_status(reply)
            completion = reply.json()
            choice = (completion.get("choices") or [{}])[0]
            part = completion_triple(choice, rest["prompt"])
            if part is None:
                raise HTTPException(502, detail="backend continued an aborted generation without token ids and "
                                                "logprobs")
            segments.append(Segment(part["generation_token_ids"], part["generation_log_probs"],
                                    dispatched or backend_model_version(completion)))
            if not was_aborted(choice):
                break
        else:
            raise HTTPException(502, detail=f"backend aborted the generation {MAX_CONTINUATIONS + 1} times")
        ids = [token for segment in segments for token in segment.token_ids]
        logprobs = [value for segment in segments for value in segment.logprobs]
        text = joined_text(await self._decode(backend, ids), choice.get("stop_reason")) if ids else ""
        last = next((segment for segment in reversed(segments) if segment.token_ids), segments[-1])
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        return self._text_turn(chat_request, text, choice.get("finish_reason"), usage,
                               {"prompt_token_ids": list(prompt_ids), "generation_token_ids": ids,
                                "generation_log_probs": logprobs}, last.model_version,
                               [(segment.model_version, len(segment.token_ids)) for segment in segments
                                if segment.token_ids])

    async def _is_paused(self, backend: Backend) -> bool:
        """vLLM's `GET /is_paused` (dev mode); a backend without the route cannot be paused."""
        try:
            reply = await self.client.get(backend.root, "/is_paused", timeout_s=self.config.timeout_s,
                                          max_retries=self.config.max_retries)
        except ServerCallError as exc:
            raise BackendUnavailable(f"backend: {exc}") from None
        if reply.status in (404, 405):
            return False
        _raise_for_status(reply)
        return bool(reply.json().get("is_paused"))

    async def _decode(self, backend: Backend, ids: list[int]) -> str:
        """The backend's `/detokenize` of `ids` (vLLM answers `prompt`, SGLang `text`)."""
        reply = await self._post(backend, "/detokenize", {"model": self.config.model, "tokens": ids}, root=True)
        if reply.status in (404, 405):
            raise BadRequest("the backend has no /detokenize", status=404)
        _raise_for_status(reply)
        answer = reply.json()
        text = answer.get("prompt", answer.get("text"))
        return text if isinstance(text, str) else ""

    async def _extended_prompt(self, backend: Backend, chat_request: dict[str, Any],
                               previous: tuple[TokenRecord, list[dict[str, Any]]]) -> list[int] | None:
        """The previous turn's tokens plus exactly what the new messages add; None when not possible."""
        record, head_messages = previous
        if backend.capabilities.get("tokenize") is False:
            return None
        tools = chat_request.get("tools")
        base, head, full = await asyncio.gather(
            self._tokenize_chat(backend, head_messages[:-1], tools, True),
            self._tokenize_chat(backend, head_messages, tools, False),
            self._tokenize_chat(backend, chat_request["messages"], tools, True),
        )
        if base is None or head is None or full is None:
            return None
        return extend_tokens(record.prompt, record.generation, head, full, base=base)

    async def _tokenize_chat(self, backend: Backend, messages: list[dict[str, Any]], tools: Any,
                             add_generation_prompt: bool) -> list[int] | None:
        """The backend's tokenization of a chat (its own chat template), or None when it cannot."""
        if backend.capabilities.get("tokenize") is False:
            return None
        body: dict[str, Any] = {"model": self.config.model, "messages": messages,
                                "add_generation_prompt": add_generation_prompt}
        if tools:
            body["tools"] = tools
        if "chat_template_kwargs" in self.config.extra_body:
            body["chat_template_kwargs"] = self.config.extra_body["chat_template_kwargs"]
        reply = await self._post(backend, "/tokenize", body, root=True)
        if reply.status in (404, 405):
            backend.capabilities["tokenize"] = False
            return None
        if not reply.ok:
            return None
        tokens = reply.json().get("tokens")
        return tokens if _is_id_list(tokens) else None

    # ------------------------------------------------------------------ other routes

    async def chat_completions(self, payload: dict[str, Any]) -> dict[str, Any]:
        adapter = self.adapter_for(payload)
        body = {**payload, "model": self.served_model(adapter) if adapter else payload.get("model") or self.config.model}

        async def call(backend: Backend) -> dict[str, Any]:
            reply = await self._post(backend, "/chat/completions", body)
            if is_context_error(reply):
                raise BadRequest("the prompt does not fit the model's context length", field="messages")
            _raise_for_status(reply)
            return reply.json()

        result, _ = await self._routed(call)
        return result

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONBytesResponse:
            """{"text": str} or {"input": Responses input, "tools", "instructions", "add_generation_prompt"}."""
            payload = await read_json(request)
            if not isinstance(payload, dict):
                raise BadRequest("required: a JSON object with 'text' or 'input'")
            if self.config.backend == "openai":
                raise BadRequest("an OpenAI backend has no tokenizer endpoint", status=404)
            if isinstance(payload.get("text"), str):
                body = {"model": self.config.model, "prompt": payload["text"], "add_special_tokens": False}

                async def call(backend: Backend) -> list[int] | None:
                    reply = await self._post(backend, "/tokenize", body, root=True)
                    _raise_for_status(reply)
                    tokens = reply.json().get("tokens")
                    return tokens if _is_id_list(tokens) else None
            elif payload.get("input") is not None:
                try:
                    chat = responses_to_chat_request(
                        {"input": payload["input"], "instructions": payload.get("instructions"),
                         "tools": payload.get("tools")}, system_role=self.config.system_role)
                except ConversionError as exc:
                    raise BadRequest(str(exc), field=exc.field) from None
                self._adapt_messages(chat["messages"])
                add_generation_prompt = payload.get("add_generation_prompt", True) is not False

                async def call(backend: Backend) -> list[int] | None:
                    return await self._tokenize_chat(backend, chat["messages"], chat.get("tools"), add_generation_prompt)
            else:
                raise BadRequest("required: 'text' (a string) or 'input' (Responses input items)", field="text")
            tokens, _ = await self._routed(call)
            if tokens is None:
                raise BadRequest("the backend has no usable /tokenize", status=404)
            return JSONBytesResponse({"tokens": tokens, "count": len(tokens)})

        @app.post("/detokenize")
        async def detokenize(request: Request) -> JSONBytesResponse:
            """{"tokens": [int], "pieces": bool} -> {"text", "pieces"?}."""
            payload = await read_json(request)
            tokens = payload.get("tokens") if isinstance(payload, dict) else None
            if not _is_id_list(tokens):
                raise BadRequest("required: a list of token ids", field="tokens")
            if self.config.backend == "openai":
                raise BadRequest("an OpenAI backend has no tokenizer endpoint", status=404)

            async def call(backend: Backend) -> dict[str, Any]:
                result: dict[str, Any] = {"text": await self._decode(backend, tokens)}
                if payload.get("pieces"):
                    result["pieces"] = list(await asyncio.gather(*(self._decode(backend, [t]) for t in tokens[:256])))
                return result

            result, _ = await self._routed(call)
            return JSONBytesResponse(result)

        @app.get("/backends")
        async def backends() -> JSONBytesResponse:
            return JSONBytesResponse({"backends": self.pool.status(), "parsing": self.parsing})

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request) -> JSONBytesResponse:
            """{"model_path": a checkpoint folder every backend can read, "weight_version"?, "pause_mode"?: wait |
            abort | keep (vLLM)} -> each backend's result (weights.py)."""
            payload = await read_json(request)
            path = payload.get("model_path") if isinstance(payload, dict) else None
            if not isinstance(path, str) or not path:
                raise BadRequest("required: the folder of the new weights", field="model_path")
            version = payload.get("weight_version")
            if version is not None and (not isinstance(version, str) or not version):
                raise BadRequest("must be a non-empty string", field="weight_version")
            mode = payload.get("pause_mode", "wait")
            if mode not in ("wait", "abort", "keep"):
                raise BadRequest("must be wait, abort or keep", field="pause_mode")
            results = await update_weights_everywhere(self, path, version, mode)
            return JSONBytesResponse({"success": True, "model_version": version or path, "backends": results})

    # ------------------------------------------------------------------ plumbing

    def _adapt_messages(self, messages: list[dict[str, Any]]) -> None:
        """Reasoning goes back the way the backend expects (chat_conversion puts it in reasoning_content)."""
        mode = self.config.reasoning_field
        if mode == "auto":
            mode = "drop" if self.config.backend == "openai" else "reasoning_content"
        if mode == "reasoning_content":
            return
        for message in messages:
            reasoning = message.pop("reasoning_content", None)
            if reasoning is None:
                continue
            if mode == "reasoning":
                message["reasoning"] = reasoning
            elif mode == "think_tags":
                message["content"] = f"<think>{reasoning}</think>" + (message.get("content") or "")

    async def _routed(self, call: Callable[[Backend], Awaitable[Any]], sticky: Backend | None = None) -> tuple[Any, Backend]:
        """Run `call` on a backend: the sticky one, else the least loaded; on failure, on another."""
        pool = self.pool
        attempts = 1 if not pool.multi else len(pool.backends) + self.config.max_retries
        tried: set[str] = set()
        last_error = "no backend"
        for attempt in range(attempts):
            backend = pool.pick(sticky, tried)
            backend.in_flight += 1
            try:
                await self.weights.admit(self, backend)
                result = await call(backend)
            except BackendUnavailable as exc:
                last_error = str(exc)
                pool.mark_down(backend)
                tried.add(backend.url)
                if len(tried) >= len(pool.backends):
                    tried.clear()
                    await asyncio.sleep(random.uniform(0, min(2.0, 0.1 * 2 ** attempt)))
                continue
            finally:
                backend.in_flight -= 1
            backend.served += 1
            return result, backend
        if not pool.multi:
            raise HTTPException(502, detail=last_error)
        raise HTTPException(502, detail=f"backend: all {len(pool.backends)} backends failed; last: {last_error}")

    async def _post(self, backend: Backend, path: str, body: dict[str, Any], root: bool = False) -> Reply:
        """POST to one backend; BackendUnavailable on no connection or 5xx (after retries with one backend)."""
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        try:
            reply = await self.client.post(
                backend.root if root else backend.url, path, json=body, headers=headers,
                timeout_s=self.config.timeout_s, max_retries=0 if self.pool.multi else self.config.max_retries,
            )
        except ServerCallError as exc:
            if exc.kind == "timeout":
                raise HTTPException(504, detail=f"backend: {exc}") from None
            raise BackendUnavailable(f"backend: {exc}") from None
        if reply.status in BACKEND_FAILURE_STATUSES or (reply.status == 429 and self.pool.multi):
            raise BackendUnavailable(f"backend answered HTTP {reply.status}: {reply.error_message()}")
        return reply


# ---------------------------------------------------------------------- helpers


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in value)


# Request fields through which vLLM or SGLang constrain a generation with a grammar.
STRUCTURED_OUTPUT_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
                          "json_schema", "regex", "ebnf")


def constrains_output(request: dict[str, Any]) -> bool:
    """Whether a grammar shaped the generation: a named or required tool choice, a JSON response format, or a
    structured-output field. Where the grammar admitted one token, the backend reports its logprob as 0.0
    exactly (the grammar's mask comes before the logprobs; one finite logit's log-softmax is 0): such a
    token was forced, not sampled, and is flagged (`generation_forced`) as the embedded model flags its
    grammar's, so the trainer does not compare its unconstrained π with μ = 1 there."""
    choice = request.get("tool_choice")
    response_format = request.get("response_format")
    return (isinstance(choice, dict) or choice == "required"
            or (isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object"))
            or any(request.get(key) is not None for key in STRUCTURED_OUTPUT_KEYS))


def _tool_choice_is_free(choice: Any) -> bool:
    """A completions prompt cannot force a tool: forced turns go through the chat endpoint."""
    return choice in (None, "auto", "none")


def _raise_for_status(reply: Reply) -> None:
    if reply.ok:
        return
    status = reply.status if 400 <= reply.status < 500 else 502
    raise HTTPException(status, detail=f"backend answered HTTP {reply.status}: {_error_text(reply)}")


def _error_text(reply: Reply) -> str:
    try:
        payload = reply.json()
    except ValueError:
        return reply.text[:500]
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return payload["message"]  # SGLang's error body: {"object": "error", "message": ...}
    return reply.error_message()


def is_context_error(reply: Reply) -> bool:
    """A 4xx saying the prompt (plus max_tokens) does not fit the model's context length."""
    if reply.status not in (400, 413, 422):
        return False
    text = reply.text.lower()
    return any(marker in text for marker in CONTEXT_ERROR_MARKERS)


def generated_ids(chat: dict[str, Any]) -> list[int] | None:
    """Generated ids of a chat completion: `choices[0].token_ids`, else from `token_id:<id>` logprob tokens."""
    choice = (chat.get("choices") or [{}])[0]
    generated = choice.get("token_ids")
    if _is_id_list(generated):
        return list(generated)
    content = (choice.get("logprobs") or {}).get("content")
    if not content:
        return None
    tokens = [str(entry.get("token", "")) for entry in content]
    if not all(token.startswith("token_id:") and token[9:].isdigit() for token in tokens):
        return None  # the backend sent token text, not ids: no exact token record
    return [int(token[9:]) for token in tokens]


def token_triple(chat: dict[str, Any], prompt_ids: list[int] | None = None) -> dict[str, Any] | None:
    """Prompt ids, generated ids and their logprobs from a chat completion, if it has them.

    vLLM (>= 0.10.2, `return_token_ids`) puts `prompt_token_ids` at the top level and `token_ids`
    on the choice; SGLang (`return_prompt_token_ids`, `return_token_ids`) puts both on the choice.
    Logprobs come per generated token in `choices[0].logprobs.content`. `prompt_ids` is used when
    the answer has none (the prompt was sent as ids, or rendered by the backend's /tokenize).
    """
    choice = (chat.get("choices") or [{}])[0]
    prompt = chat.get("prompt_token_ids") or choice.get("prompt_token_ids") or prompt_ids
    generated = generated_ids(chat)
    content = (choice.get("logprobs") or {}).get("content")
    if not _is_id_list(prompt) or generated is None or content is None:
        return None
    try:
        logprobs = [float(entry["logprob"]) for entry in content]
    except (KeyError, TypeError, ValueError):
        return None
    if len(logprobs) != len(generated):
        return None
    return {"prompt_token_ids": list(prompt), "generation_token_ids": generated, "generation_log_probs": logprobs}


def completion_triple(choice: dict[str, Any], prompt_ids: list[int]) -> dict[str, Any] | None:
    """The token record of a vLLM /v1/completions choice (`token_ids`, `prompt_token_ids`, `logprobs`)."""
    logprobs = choice.get("logprobs") or {}
    values = logprobs.get("token_logprobs")
    generated = choice.get("token_ids")
    if not _is_id_list(generated):
        tokens = [str(token) for token in logprobs.get("tokens") or []]
        if not tokens or not all(t.startswith("token_id:") and t[9:].isdigit() for t in tokens):
            return None
        generated = [int(t[9:]) for t in tokens]
    if not isinstance(values, list) or len(values) != len(generated) or any(v is None for v in values):
        return None
    prompt = choice.get("prompt_token_ids")
    return {"prompt_token_ids": list(prompt) if _is_id_list(prompt) else list(prompt_ids),
            "generation_token_ids": list(generated), "generation_log_probs": [float(v) for v in values]}


def backend_model_version(answer: dict[str, Any]) -> str | None:
    """A weights version reported by the backend (`model_version`, `weight_version`, SGLang's meta_info)."""
    for source in (answer, (answer.get("choices") or [{}])[0].get("meta_info") or {}, answer.get("meta_info") or {}):
        if isinstance(source, dict):
            for key in ("model_version", "weight_version"):
                if source.get(key) is not None:
                    return str(source[key])
    return None
