"""Generations the backend aborted for a weight update, continued on the new weights (in-flight updates).

vLLM (0.32, dev mode) pauses for a weight update with `POST /pause?mode=abort`: every running request ends
at once, and its non-streaming answer comes back as usual but with `finish_reason: "abort"` and the tokens
generated so far (ids and logprobs, `token_ids` possibly empty). Requests sent while it is paused wait
for `POST /resume`. With `continue_aborted`, the model server keeps an aborted generation's tokens, polls
`GET /is_paused` until the engine runs again (at most `resume_wait_s`), and asks for the rest: the prompt
plus the partial completion as a token-id prompt, `max_tokens` (and `min_tokens`) less what was generated,
as often as it is aborted. The answer is one generation whose ids and logprobs are the segments' in
order, exactly as if it had not been interrupted (the next turn still extends prompt + generation), and
whose `model_version_spans` say which weights sampled how many of its tokens: one span per segment that
produced tokens, the version the server knew when it sent that segment's request (a reload through the
server holds new requests until the backend has its version, so an aborted segment keeps the version it began
on and its continuation gets the new one).

This module holds what does not need the server: the segments, the continuation's request body, the
spans and the wait for the engine.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import HTTPException

ABORTED = "abort"  # vLLM's finish_reason for a request ended by /pause?mode=abort or /abort_requests
MAX_CONTINUATIONS = 32  # aborts of one generation before it fails: an engine that aborts it for ever
POLL_FIRST_S, POLL_MAX_S = 0.05, 1.0


@dataclass
class Segment:
    """The tokens one backend call generated before it ended (aborted or finished) and the version that
    sampled them (the server's raw version, read when the call was sent; None when unknown)."""

    token_ids: list[int]
    logprobs: list[float]
    model_version: str | None


def was_aborted(choice: dict[str, Any]) -> bool:
    """Whether the backend ended this choice by aborting it (not a stop, not a length cut)."""
    return choice.get("finish_reason") == ABORTED


def continuation_body(body: dict[str, Any], prompt_ids: list[int], generated: list[int]) -> dict[str, Any] | None:
    """The /v1/completions body that asks for the rest of a generation: `body` (the first call's) with the
    prompt extended by what was generated, and the budgets less it. None when `max_tokens` is used up."""
    rest = dict(body, prompt=[*prompt_ids, *generated])
    if isinstance(body.get("max_tokens"), int):
        rest["max_tokens"] = body["max_tokens"] - len(generated)
        if rest["max_tokens"] <= 0:
            return None
    if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 0:
        rest["min_tokens"] = max(0, body["min_tokens"] - len(generated))
    return rest


def version_spans(segments: list[Segment], resolve: Callable[[str | None], str]) -> list[dict[str, Any]]:
    """`model_version_spans`: one `{model_version, tokens}` per segment that generated tokens, in order,
    each raw version resolved to the one the server reports."""
    return [{"model_version": resolve(segment.model_version), "tokens": len(segment.token_ids)}
            for segment in segments if segment.token_ids]


async def wait_until_resumed(is_paused: Callable[[], Awaitable[bool]], bound_s: float, generated: int) -> float:
    """Poll `is_paused` until it says False; the seconds waited. HTTPException 503 (the cause named, a
    failure and never a reward) when the engine is still paused after `bound_s`."""
    started = time.monotonic()
    delay = POLL_FIRST_S
    while await is_paused():
        waited = time.monotonic() - started
        if waited >= bound_s:
            raise HTTPException(503, detail=f"backend: still paused {waited:.1f} s after it aborted the generation "
                                            f"(GET /is_paused; resume_wait_s is {bound_s:g}); the {generated} tokens "
                                            "generated before the pause are not continued")
        await asyncio.sleep(min(delay, max(0.0, bound_s - waited)))
        delay = min(delay * 2, POLL_MAX_S)
    return time.monotonic() - started


def joined_text(full_text: str, stop_reason: Any) -> str:
    """The text of the whole generation, decoded from all its ids at once (a character split across the
    abort is whole again), less a stop string that ended the last segment (vLLM leaves it out of `text`
    but keeps its tokens)."""
    if isinstance(stop_reason, str) and stop_reason and stop_reason in full_text:
        return full_text[: full_text.rfind(stop_reason)]
    return full_text


__all__ = ["ABORTED", "MAX_CONTINUATIONS", "Segment", "continuation_body", "joined_text", "version_spans",
           "wait_until_resumed", "was_aborted"]
