"""The scoring contract of model servers: `POST /v1/score`, the logprob a model gives tokens it did not
generate (a teacher scoring a student's rollout, for on-policy distillation).

    request  {"model": "teacher",                 optional: which weights answer (an adapter's name)
              "prompt_token_ids": [int, ...],     at least one token: the context of the first scored token
              "completion_token_ids": [int, ...], the tokens to score
              "temperature": 1.0}                 optional: logits / T before the softmax (1: the model's own)
    answer   {"model", "model_version",
              "logprobs": [float, ...],           one per completion token: log p(c_j | prompt, c_<j)
              "vocab_size": int, "prompt_tokens": int, "completion_tokens": int}

As vLLM's `prompt_logprobs` on the concatenation `prompt + completion` without its leading None: every
token is scored under the full softmax of its position (no top-p, no grammar), teacher-forced. The ids
are the caller's: a server refuses (422) an id outside its vocabulary, which is how a teacher whose
tokenizer is not the student's is caught at the first call; `GET /v1/models` cards and the answer carry
`vocab_size`, and `tokenizer_problem` compares two servers' tokenizations of a probe text before a run
relies on them (rollgym.train.loop.teacher).
"""

from __future__ import annotations

from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .sampling_contract import DEFAULT_TEMPERATURE
from .server import BadRequest

# A text whose tokens exercise what tokenizers disagree on: chat markers, digits, accents, spacing, JSON.
PROBE_TEXT = ('<|im_start|>user\nWhat is the weather in São Paulo, 2026-11-26?<|im_end|>\n'
              '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
              '</tool_call><|im_end|>  \t ÿ 東京 🙂')


class ScoreRequest(BaseModel):
    """The body of `POST /v1/score` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt_token_ids: list[int] = Field(min_length=1)
    completion_token_ids: list[int] = Field(min_length=1)
    temperature: float = Field(default=DEFAULT_TEMPERATURE, gt=0)

    @model_validator(mode="after")
    def _ids(self) -> "ScoreRequest":
        for field in ("prompt_token_ids", "completion_token_ids"):
            if any(token < 0 for token in getattr(self, field)):
                raise ValueError(f"{field}: token ids are non-negative")
        return self

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_token_ids + self.completion_token_ids


def check_vocabulary(request: ScoreRequest, vocab_size: int, server: str) -> None:
    """BadRequest (422, naming the field) when an id is outside the server's vocabulary: the ids were made
    by another tokenizer."""
    for field in ("prompt_token_ids", "completion_token_ids"):
        ids = getattr(request, field)
        if ids and max(ids) >= vocab_size:
            raise BadRequest(f"token id {max(ids)} is outside the vocabulary of {server!r} ({vocab_size} tokens): "
                             "the ids come from another tokenizer; a teacher must share the student's tokenizer",
                             field=field)


def score_answer(request: ScoreRequest, logprobs: Sequence[float], *, model: str, version: str,
                 vocab_size: int | None) -> dict[str, Any]:
    """The JSON answer of `POST /v1/score` (`vocab_size` None: the server's backend does not say)."""
    if len(logprobs) != len(request.completion_token_ids):
        raise RuntimeError(f"scored {len(logprobs)} tokens of {len(request.completion_token_ids)}")
    return {"object": "score", "model": model, "model_version": version, "logprobs": [float(x) for x in logprobs],
            "vocab_size": vocab_size, "prompt_tokens": len(request.prompt_token_ids),
            "completion_tokens": len(request.completion_token_ids)}


def tokenizer_problem(student: Sequence[int], teacher: Sequence[int]) -> str | None:
    """Why two tokenizations of PROBE_TEXT show different tokenizers (None: the same ids)."""
    if list(student) == list(teacher):
        return None
    first = next((i for i, (a, b) in enumerate(zip(student, teacher)) if a != b), min(len(student), len(teacher)))
    return (f"the tokenizers differ: the probe text is {len(student)} tokens for the student and {len(teacher)} "
            f"for the teacher, first different at token {first}")


__all__ = ["PROBE_TEXT", "ScoreRequest", "check_vocabulary", "score_answer", "tokenizer_problem"]
