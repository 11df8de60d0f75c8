"""reverse_text: a single-turn task, "reverse this text", with graded credit.

Reward = LCS(answer, reversed text) / max(len(answer), len(reversed text)): 1.0 for an exact
answer, partial credit for a near miss, and less for padding the answer with extra text. A small
model gets rewards spread between 0 and 1, so GRPO groups have variance to learn from.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from rollgym import ResourcesServer, RunRequest, Verdict
from rollgym.text import final_message_text

QUOTES = "\"'`“”‘’"


MAX_TEXT_CHARS = 10_000
# Grading cost grows with len(answer) x len(text); work above this many character pairs leaves the event loop.
OFF_LOOP_PAIRS = 1_000_000


class ReverseTextTask(RunRequest):
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, description="the text the model must reverse")


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of a and b (Hyyrö's bit-parallel algorithm).

    O(len(a) * len(b) / word size).
    """
    if not a or not b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    masks: dict[str, int] = {}
    for index, char in enumerate(a):
        masks[char] = masks.get(char, 0) | (1 << index)
    full = (1 << len(a)) - 1
    row = full
    for char in b:
        matched = row & masks.get(char, 0)
        row = ((row + matched) | (row - matched)) & full
    return len(a) - row.bit_count()


def clean_answer(answer: str) -> str:
    """The answer without surrounding whitespace, quotes or backticks."""
    return answer.strip().strip(QUOTES).strip()


def reverse_reward(answer: str, text: str) -> float:
    """LCS ratio between the cleaned answer and the reversed text, in [0, 1].

    An answer over four times the target's length is matched on its first 4x+16 characters (and
    still divided by its full length), which bounds the grading work whatever a client sends.
    """
    target = text[::-1]
    answer = clean_answer(answer)
    if not answer:
        return 0.0
    graded = answer[: 4 * len(target) + 16]
    return lcs_length(graded, target) / max(len(answer), len(target))


class ReverseTextServer(ResourcesServer):
    task_model = ReverseTextTask

    async def verify(self, request: ReverseTextTask, state: dict[str, Any]) -> Verdict:
        answer = final_message_text(request.response.output)
        if len(answer) * len(request.text) > OFF_LOOP_PAIRS:
            reward = await asyncio.to_thread(reverse_reward, answer, request.text)
        else:
            reward = reverse_reward(answer, request.text)
        return Verdict(reward=reward, details={"expected_answer": request.text[::-1],
                                               "exact": clean_answer(answer) == request.text[::-1]})
