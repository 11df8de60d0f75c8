"""Wire types: Responses API items and params, and the /run and /verify bodies.

Items reuse the `openai` package's Responses types and add the optional training fields
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`) that a model server puts on
the items it generated, so that the next turn's prompt can extend the exact same tokens.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from openai.types.responses import (
    EasyInputMessage,
    FunctionTool,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseReasoningItem,
    ResponseUsage,
    ToolChoiceFunction,
)
from openai.types.responses.response_input_item import FunctionCallOutput as _FunctionCallOutput
from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, Tag, ValidationInfo, field_validator,
                      model_validator)

from .statuses import FAILURE_STATUSES, POLICY_STATUSES, RolloutStatus

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class VersionSpan(BaseModel):
    """`tokens` consecutive tokens sampled by the weights `model_version` (in-flight updates); None: not known, or
    (in a sequence's `completion_version_spans`) tokens the environment added."""

    model_version: str | None = None
    tokens: int = Field(ge=1)


class TokenFields(BaseModel):
    """The token-level record of one model call, carried by the item that call generated."""

    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None
    # Which weights produced the tokens, for off-policy trainers; set by servers that know it. With
    # `model_version_spans`, the version of the last token.
    model_version: str | None = None
    # A generation that went on across weight updates (continued after an abort): which version sampled how
    # many of `generation_token_ids`, in order; the counts add up to their length. Absent: all `model_version`'s.
    model_version_spans: list[VersionSpan] | None = None
    # What they were sampled under: temperature, top_p, top_k, and `logprobs` "raw" | "processed".
    sampling: dict[str, Any] | None = None
    # 1 where a grammar (a forced tool call) admitted no other token.
    generation_forced: list[int] | None = None
    # 1 where a grammar restricted the choice (every token of a grammar-constrained call, forced ones too):
    # sampled from the model's distribution renormalised over what the grammar admitted, not from the
    # model's own distribution, which the logprobs are of.
    generation_constrained: list[int] | None = None

    @model_validator(mode="after")
    def _all_or_none(self) -> "TokenFields":
        present = [getattr(self, name) is not None for name in TOKEN_FIELDS]
        if any(present) and not all(present):
            missing = [name for name, has in zip(TOKEN_FIELDS, present) if not has]
            raise ValueError(f"token fields come all three or none; missing {', '.join(missing)}")
        if all(present) and len(self.generation_token_ids) != len(self.generation_log_probs):
            raise ValueError(
                f"generation_log_probs has {len(self.generation_log_probs)} values for "
                f"{len(self.generation_token_ids)} generation_token_ids"
            )
        if self.model_version_spans is not None and self.generation_token_ids is not None:
            spanned = sum(span.tokens for span in self.model_version_spans)
            if spanned != len(self.generation_token_ids):
                raise ValueError(f"model_version_spans cover {spanned} tokens of {len(self.generation_token_ids)} "
                                 "generation_token_ids")
        return self


class OutputMessage(TokenFields, ResponseOutputMessage):
    """An assistant message the model generated (`type: message`, `role: assistant`, output_text parts)."""


class FunctionCall(TokenFields, ResponseFunctionToolCall):
    """A tool call the model generated; `arguments` is a JSON string."""


class Reasoning(TokenFields, ResponseReasoningItem):
    """Reasoning text the model generated (summary and/or content parts)."""


class FunctionCallOutput(_FunctionCallOutput):
    """A tool's result, fed back to the model on the next turn."""

    call_id: str


class InputMessage(EasyInputMessage):
    """A plain message written by the user, system, developer, or an assistant turn given as text."""


def _input_item_kind(value: Any) -> str:
    """Pick the item model: generated assistant messages carry an id and output_text parts."""
    get = value.get if isinstance(value, dict) else lambda key, default=None: getattr(value, key, default)
    kind = get("type") or "message"
    if kind == "message":
        if get("role") == "assistant" and get("id") is not None and not isinstance(get("content"), str):
            return "output_message"
        return "message"
    return kind


InputItem = Annotated[
    Union[
        Annotated[InputMessage, Tag("message")],
        Annotated[OutputMessage, Tag("output_message")],
        Annotated[FunctionCall, Tag("function_call")],
        Annotated[FunctionCallOutput, Tag("function_call_output")],
        Annotated[Reasoning, Tag("reasoning")],
    ],
    Discriminator(_input_item_kind),
]

OutputItem = Annotated[
    Union[
        Annotated[OutputMessage, Tag("message")],
        Annotated[FunctionCall, Tag("function_call")],
        Annotated[FunctionCallOutput, Tag("function_call_output")],
        Annotated[Reasoning, Tag("reasoning")],
    ],
    Discriminator(lambda v: v.get("type") if isinstance(v, dict) else getattr(v, "type", None)),
]

ToolChoice = Union[Literal["auto", "none", "required"], ToolChoiceFunction]


class ResponsesCreateParams(BaseModel):
    """The body of `POST /v1/responses` (the fields rollgym reads; others pass through)."""

    model_config = ConfigDict(extra="allow")

    input: Union[str, list[InputItem]]
    model: str | None = None
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(default=None, ge=1)
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    seed: int | None = None

    @field_validator("tool_choice")
    @classmethod
    def _named_tool_exists(cls, choice: Any, info: ValidationInfo) -> Any:
        if isinstance(choice, ToolChoiceFunction):
            names = {tool.name for tool in info.data.get("tools") or []}
            if choice.name not in names:
                raise ValueError(f"names function {choice.name!r}, which is not in tools")
        return choice


class ModelResponse(Response):
    """A Responses API response whose output items may carry token fields, and the weights that made it."""

    output: list[OutputItem]  # type: ignore[assignment]
    model_version: str | None = None


class RunRequest(BaseModel):
    """A task row: the model request plus any task fields the environment needs (kept as extras)."""

    model_config = ConfigDict(extra="allow")

    responses_create_params: ResponsesCreateParams
    rollout_id: str | None = None
    group_id: str | None = None
    # Run the loop but not `/verify`: the rollout comes back with `reward: null` and `verification: "skipped"`
    # (data for SFT, distillation or filtering; never for reward-based training).
    skip_verification: StrictBool = False


class VerifyRequest(RunRequest):
    """What the agent sends to a resources server's `/verify`: the task row and the final response."""

    response: ModelResponse


class VerifyResponse(VerifyRequest):
    """`/verify`'s answer: the request echoed back with the reward."""

    reward: float
    reward_components: dict[str, float] | None = None
    # Per-role rewards beside the episode's (several policies: each trains on its own; docs/train-policies.md).
    rewards: dict[str, float] | None = None


class RolloutMetrics(BaseModel):
    turns: int = 0
    tool_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0
    model_latency_s: float = 0.0
    env_latency_s: float = 0.0


class Sequence(BaseModel):
    """One token sequence of a rollout for trainers: a prompt and a completion with its loss mask.

    `completion_mask` is 1 for tokens the model sampled and 0 for tokens the environment added
    between turns; `completion_logprobs` is 0.0 where the mask is 0.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    # One entry per model call merged into this sequence, when the model server reports versions.
    model_versions: list[str | None] | None = None
    # When a call's generation went on across weight updates (its item has `model_version_spans`): the
    # version of every completion token as spans in order, adding up to len(completion_ids); environment
    # tokens are spans with model_version None.
    completion_version_spans: list[VersionSpan] | None = None
    # 1 where a grammar forced the token (not sampled: out of the policy loss), when the server reports it.
    completion_forced: list[int] | None = None
    # 1 where a grammar restricted the choice (`generation_constrained`), when the server reports it.
    completion_constrained: list[int] | None = None
    # Set by agents whose rollouts branch into several sequences: whether this one's turns extend each other.
    prefix_ok: bool | None = None
    # Set by agents that know a rollout's conversations (proxy_agent): the conversation this segment belongs to
    # and, after the first segment, why it began (rollgym.sequences.SEGMENT_REASONS).
    conversation: int | None = None
    segment_reason: Literal["new_conversation", "history_rewritten", "tokens_drifted", "another_policy"] | None = None
    # With named policies (rollgym.policies): the policy whose calls this segment is; it trains on it alone.
    policy: str | None = None
    # Set by agents whose segments have inputs of their own (proxy_agent): each model call of this segment, its
    # input items (a continuing call's: only those it added) and output items, without token fields; what
    # `rollgym view` shows as the segment's conversation. Trainers ignore it.
    calls: list[dict[str, Any]] | None = None


class RunResponse(RunRequest):
    """`POST /run`'s answer: the verify response plus rollgym's status, metrics and token view.

    `reward` is None exactly when `status` is an infrastructure failure (a failure is never a reward) or
    when the run was asked to skip verification: then `verification` is "skipped" and `status` the policy's.
    """

    response: ModelResponse | None = None
    reward: float | None = None
    verification: Literal["skipped"] | None = None
    reward_components: dict[str, float] | None = None
    rewards: dict[str, float] | None = None
    status: RolloutStatus
    error: str | None = None
    metrics: RolloutMetrics = Field(default_factory=RolloutMetrics)
    sequences: list[Sequence] | None = None
    prefix_ok: bool | None = None


class RolloutLine(RunResponse):
    """One line of a collection's rollouts file, as the format specification writes a rollout: /run's answer
    with the response's output items at the top (`output`; `response` keeps its id, model, usage and version)
    and `metadata`, the task's fields other than the request. Readers take `response.output` too (the
    answer of /run itself, and lines written before): `rollgym.data.records.output_items`."""

    response: dict[str, Any] | None = None  # type: ignore[assignment]
    output: list[OutputItem]
    metadata: dict[str, Any] = Field(default_factory=dict)


__all__ = [
    "TOKEN_FIELDS",
    "FAILURE_STATUSES",
    "POLICY_STATUSES",
    "FunctionCall",
    "FunctionCallOutput",
    "FunctionTool",
    "InputItem",
    "InputMessage",
    "ModelResponse",
    "OutputItem",
    "OutputMessage",
    "Reasoning",
    "ResponseUsage",
    "ResponsesCreateParams",
    "RolloutLine",
    "RolloutMetrics",
    "RolloutStatus",
    "RunRequest",
    "RunResponse",
    "Sequence",
    "TokenFields",
    "VerifyRequest",
    "VersionSpan",
    "VerifyResponse",
]
