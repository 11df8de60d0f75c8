"""reverse_text: a single-turn task, "reverse this text", with graded credit.

Reward = LCS(answer, reversed text) / max(len(answer), len(reversed text)): 1.0 for an exact
answer, partial credit for a near miss, and less for padding the answer with extra text. A small
model gets rewards spread between 0 and 1, so GRPO groups have variance to learn from.

What is graded is the final answer as a reader sees it: the last assistant message (none when the
response ends with a tool call), less its `<think>` reasoning, both texts in Unicode's composed form
(NFC) without invisible characters (zero-width spaces). Quotes or backticks wrapping the answer are not
held against it (nor are the text's own quotes: the better of the two readings counts). These earn 0
with their reason: an empty answer, one only inside `<think>`, and one that holds the text as given
(the prompt or the text copied back) when that is not also the reversal. Every verdict below 1.0 has a
`reason`.
"""

from __future__ import annotations

import asyncio
import unicodedata
from typing import Any

from pydantic import Field

from rollgym import ResourcesServer, RunRequest, Verdict
from rollgym.text import final_answer_text, final_message_text, without_reasoning

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


def readable(text: str) -> str:
    """Composed form (NFC), without invisible format characters: what a reader sees, as one string."""
    text = unicodedata.normalize("NFC", text)
    return "".join(c for c in text if unicodedata.category(c) != "Cf")


def _ratio(answer: str, target: str) -> tuple[float, int]:
    graded = answer[: 4 * len(target) + 16]
    common = lcs_length(graded, target)
    return common / max(len(answer), len(target)), common


def reverse_verdict(answer: str, text: str) -> tuple[float, dict[str, Any]]:
    """(reward, details) of a final answer: the LCS ratio of `reverse_reward`, or 0.0 for an answer that is
    empty, only reasoning, or holds the text as given; details carry `exact` and, below 1.0, a `reason`."""
    if not answer.strip():
        return 0.0, {"exact": False, "reason": "empty answer"}
    shown = without_reasoning(answer)
    if not shown.strip():
        return 0.0, {"exact": False, "reason": "the answer is only inside <think> reasoning"}
    given = readable(text)
    target = given[::-1]
    shown = readable(shown)
    if not clean_answer(shown):
        return 0.0, {"exact": False, "reason": "empty answer (quotes or whitespace only)"}
    readings = list(dict.fromkeys((shown.strip(), clean_answer(shown))))
    if target in readings:
        return 1.0, {"exact": True}
    if len(given.strip()) >= 3 and given not in target and given in shown:
        return 0.0, {"exact": False, "reason": "the answer holds the text as given, not reversed"}
    (reward, common), reading = max((_ratio(reading, target), reading) for reading in readings)
    return reward, {"exact": False, "reason": f"not the reversed text: {common} of its {len(target)} characters "
                                              f"in order, in an answer {len(reading)} long" if reward else
                                              "nothing in common with the reversed text"}


def reverse_reward(answer: str, text: str) -> float:
    """LCS ratio between the cleaned answer and the reversed text, in [0, 1] (see `reverse_verdict`).

    An answer over four times the target's length is matched on its first 4x+16 characters (and
    still divided by its full length), which bounds the grading work whatever a client sends.
    """
    return reverse_verdict(answer, text)[0]


class ReverseTextServer(ResourcesServer):
    task_model = ReverseTextTask

    async def verify(self, request: ReverseTextTask, state: dict[str, Any]) -> Verdict:
        output = request.response.output
        answer = final_answer_text(output)
        if not answer.strip() and final_message_text(output).strip():
            # An answer written before a tool call, with none after it, is no final answer.
            reward, details = 0.0, {"exact": False, "reason": "no final answer: the response ends with a tool call "
                                                              "or its output"}
        elif len(answer) * len(request.text) > OFF_LOOP_PAIRS:
            reward, details = await asyncio.to_thread(reverse_verdict, answer, request.text)
        else:
            reward, details = reverse_verdict(answer, request.text)
        return Verdict(reward=reward, details={"expected_answer": request.text[::-1], **details})
