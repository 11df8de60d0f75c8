"""openai_responses: a passthrough to the OpenAI Responses API through the official `openai` SDK.

Requests go to `AsyncOpenAI().responses.create` as they came, less what OpenAI would reject:
rollgym's token fields on echoed items (`prompt_token_ids`, `generation_token_ids`,
`generation_log_probs`, `model_version`) and parameters the Responses API does not have (e.g.
`seed`). At most `max_concurrency` requests are in flight; 429, 5xx and connection errors are
retried by the SDK (`max_retries`, with its backoff and `Retry-After` handling). A context-length
error becomes `status: incomplete` (`incomplete_details.reason: max_output_tokens`), not a 500.
OpenAI returns no token ids, so these rollouts have no `sequences`: use them for evaluation,
judging or distillation data, not for on-policy RL.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import openai
from fastapi import HTTPException
from openai import AsyncOpenAI
from pydantic import Field

from rollgym import ModelServer, ResponsesCreateParams, ServerConfig, build_response
from rollgym.server import ServerStartError

STRIPPED_ITEM_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "model_version")
CONTEXT_ERROR_MARKERS = ("context_length_exceeded", "maximum context length", "context window", "too many tokens")


class OpenAIResponsesConfig(ServerConfig):
    model: str = Field(description="the OpenAI model, e.g. gpt-4.1-mini")
    api_key: str | None = Field(default=None, description="use ${oc.env:OPENAI_API_KEY}; never write it in a file")
    base_url: str | None = Field(default=None, description="default: the SDK's (https://api.openai.com/v1)")
    organization: str | None = None
    project: str | None = None
    max_concurrency: int = Field(default=16, ge=1, description="requests in flight at once")
    max_retries: int = Field(default=3, ge=0, description="SDK retries on 429, 5xx and connection errors")
    timeout_s: float = Field(default=600.0, gt=0)
    store: bool | None = Field(default=False, description="let OpenAI store responses (null: the API's default)")
    include_encrypted_reasoning: bool = Field(
        default=True, description="with store false, ask for reasoning.encrypted_content so reasoning items can go back")
    model_version: str | None = Field(default=None, description="reported on generated items (default: the response's model)")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="extra request fields for every call")


class OpenAIResponsesModel(ModelServer):
    config_class = OpenAIResponsesConfig
    config: OpenAIResponsesConfig

    @classmethod
    def live_check_skip_reason(cls, config: OpenAIResponsesConfig) -> str | None:
        return None if config.api_key else "needs an OpenAI API key (set OPENAI_API_KEY)"

    def __init__(self, config: OpenAIResponsesConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.config.api_key:
            raise ServerStartError(
                f"model server {self.name!r} has no OpenAI API key: set OPENAI_API_KEY (the config reads "
                "${oc.env:OPENAI_API_KEY}), or api_key for another Responses endpoint")
        self._client: AsyncOpenAI | None = None
        self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        self.in_flight = 0

    def model_names(self) -> list[str]:
        return [self.config.model]

    def openai_client(self) -> AsyncOpenAI:
        if self._client is None:
            config = self.config
            self._client = AsyncOpenAI(
                api_key=config.api_key, base_url=config.base_url, organization=config.organization,
                project=config.project, max_retries=config.max_retries, timeout=config.timeout_s,
            )
        return self._client

    async def shutdown(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        kwargs = self.request_kwargs(payload)
        async with self._semaphore:
            self.in_flight += 1
            try:
                response = await self.openai_client().responses.create(**kwargs)
            except openai.APIStatusError as exc:
                if _is_context_error(exc):
                    return build_response(payload, [], model=self.config.model, status="incomplete",
                                          incomplete_details={"reason": "max_output_tokens"})
                status = exc.status_code if 400 <= exc.status_code < 500 else 502
                raise HTTPException(status, detail=f"OpenAI answered HTTP {exc.status_code}: {_message(exc)}") from None
            except openai.APITimeoutError:
                raise HTTPException(504, detail=f"OpenAI: no answer within {self.config.timeout_s:g} s") from None
            except openai.APIConnectionError as exc:
                raise HTTPException(502, detail=f"OpenAI: connection failed: {exc}") from None
            finally:
                self.in_flight -= 1
        return self.to_rollgym(response.model_dump(mode="json", exclude_unset=True, warnings=False))

    def request_kwargs(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`responses.create` arguments: the Responses parameters of the request, cleaned for OpenAI."""
        known = _create_parameters()
        kwargs = {key: value for key, value in payload.items() if key in known and value is not None}
        kwargs["model"] = self.config.model
        kwargs.pop("stream", None)
        if isinstance(payload.get("input"), list):
            kwargs["input"] = [_clean_item(item) for item in payload["input"]]
        if self.config.store is not None:
            kwargs.setdefault("store", self.config.store)
        if kwargs.get("store") is False and self.config.include_encrypted_reasoning:
            include = list(kwargs.get("include") or [])
            if "reasoning.encrypted_content" not in include:
                include.append("reasoning.encrypted_content")
            kwargs["include"] = include
        if self.config.extra_body:
            kwargs["extra_body"] = dict(self.config.extra_body)
        return kwargs

    def to_rollgym(self, data: dict[str, Any]) -> dict[str, Any]:
        """The OpenAI response as rollgym serves it: complete usage, the model version on generated items."""
        usage = data.get("usage") or {}
        input_details = usage.get("input_tokens_details") or {}
        output_details = usage.get("output_tokens_details") or {}
        input_tokens, output_tokens = int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
        data["usage"] = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": int(input_details.get("cached_tokens") or 0),
                                     "cache_write_tokens": int(input_details.get("cache_write_tokens") or 0)},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": int(output_details.get("reasoning_tokens") or 0)},
            "total_tokens": int(usage.get("total_tokens") or input_tokens + output_tokens),
        }
        version = self.config.model_version or data.get("model")
        for item in data.get("output") or []:
            if isinstance(item, dict) and item.get("type") in ("message", "function_call", "reasoning") and version:
                item["model_version"] = str(version)
        if version:
            data["model_version"] = str(version)  # on the Response too, as every model server reports it
        data.setdefault("parallel_tool_calls", True)
        data.setdefault("tool_choice", "auto")
        data.setdefault("tools", [])
        return data


_CREATE_PARAMETERS: frozenset[str] | None = None


def _create_parameters() -> frozenset[str]:
    """The keyword parameters of this SDK version's `responses.create` (so unknown keys never reach it)."""
    global _CREATE_PARAMETERS
    if _CREATE_PARAMETERS is None:
        from openai.resources.responses import AsyncResponses

        signature = inspect.signature(AsyncResponses.create)
        _CREATE_PARAMETERS = frozenset(
            name for name in signature.parameters
            if name not in ("self", "extra_headers", "extra_query", "extra_body", "timeout"))
    return _CREATE_PARAMETERS


def _clean_item(item: Any) -> Any:
    if not isinstance(item, dict):
        return item
    return {key: value for key, value in item.items() if key not in STRIPPED_ITEM_FIELDS}


def _message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error") if isinstance(body.get("error"), dict) else body
        if isinstance(error.get("message"), str):
            return error["message"]
    return str(exc.message)


def _is_context_error(exc: openai.APIStatusError) -> bool:
    if exc.status_code != 400:
        return False
    code = getattr(exc, "code", None)
    text = f"{code} {_message(exc)}".lower()
    return any(marker in text for marker in CONTEXT_ERROR_MARKERS)
