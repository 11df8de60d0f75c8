"""math: a single-turn maths problem graded by `math-verify` (symbolic equivalence, not string match).

Reward 1.0 when the model's final answer (its `\\boxed{}` if there is one, else the last LaTeX or
plain expression) is mathematically equivalent to `expected_answer`, else 0.0, always with a reason.
The answer is read as a policy that games the grader would write it (see answer_problem): only the
final message counts (not one before a tool call), `<think>` reasoning is left out, digits of any
script count as ASCII digits, and hedges are refused: boxes that disagree, a box inside a box,
an expression copied from the question. Grading that overruns its deadline is 0.0 with reason
"timeout".

math-verify's own timeouts use `signal.alarm`, which only works on the main thread, so they are
turned off here (`parsing_timeout=None`, `timeout_seconds=None`) and grading runs in a small
bounded thread pool under an `asyncio.wait_for` deadline instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from pydantic import Field, field_validator

from rollgym import BadRequest, ResourcesServer, ResourcesServerConfig, RunRequest, Verdict
from rollgym.text import (
    ascii_digits,
    boxed_contents,
    final_answer_text,
    final_message_text,
    last_boxed,
    message_text,
    without_reasoning,
)

# math-verify warns, once per process, that its own timeouts are off: the deadline here is ours
# (see the module doc), so the warning is noise in every server log and `rollgym test` output.
logging.getLogger("math_verify").setLevel(logging.ERROR)

# The model's answer: LaTeX first, \boxed{} at top priority, then plain expressions such as "0.5".
ANSWER_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())
# Only the last part of a long answer is searched: the final answer is at the end, and a bounded
# input keeps the regexes and sympy fast.
MAX_ANSWER_CHARS = 4000
GOLD_UNPARSABLE = "the expected answer could not be parsed"
# More boxes than this in one answer is a spray of guesses, refused without parsing each one.
MAX_BOXES = 8


class MathTask(RunRequest):
    expected_answer: str = Field(min_length=1, description='the gold answer: "42", "\\\\frac{1}{2}", "x^2+1"...')

    @field_validator("expected_answer", mode="before")
    @classmethod
    def _numbers_as_text(cls, value: Any) -> Any:
        # A dataset may carry 42 or 0.5 as JSON numbers; they mean the same as "42" and "0.5".
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        return value

    @field_validator("expected_answer")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value


class MathServerConfig(ResourcesServerConfig):
    grading_timeout_s: float = Field(default=10.0, gt=0, description="deadline for grading one answer")
    grading_workers: int = Field(default=2, ge=1, description="threads that run math-verify")


@dataclass
class MathResult:
    reward: float
    details: dict[str, Any] = field(default_factory=dict)


def gold_text(expected: str) -> str:
    """The gold answer as math-verify's default extraction finds it.

    A bare "x^2+1" or "3\\sqrt{3}" is not picked up (or only its first number) unless it is
    delimited, so an undelimited gold is wrapped in \\boxed{}; "42" and "\\frac{1}{2}" parse
    the same either way.
    """
    text = expected.strip()
    if "$" in text or "\\boxed" in text or "\\(" in text or "\\[" in text:
        return text
    return f"\\boxed{{{text}}}"


def parse_gold(expected: str) -> list[Any]:
    """The parsed gold answer (default extraction config); [] when it cannot be parsed.

    math-verify keeps the raw string when sympy cannot read it ("\\frac{" comes back as a string);
    such a gold could only ever match the same broken string, so it counts as unparsable.
    """
    parsed = parse(gold_text(expected), parsing_timeout=None)
    return parsed if any(not isinstance(item, str) for item in parsed) else []


def last_boxed_expression(text: str) -> str | None:
    """The last complete `\\boxed{...}` of text, box included (math-verify reads the box), or None."""
    content = last_boxed(text)
    return None if content is None else f"\\boxed{{{content}}}"


def parse_answer(answer: str) -> list[Any]:
    """The parsed model answer: [sympy expression, extracted string], or [] when nothing is found.

    With a \\boxed{} in the answer only the last one is parsed: math-verify on its own joins nearby
    boxes into a set ("\\boxed{4}, no wait, \\boxed{6}" would be {4, 6}).
    """
    text = answer[-MAX_ANSWER_CHARS:]
    return parse(last_boxed_expression(text) or text, extraction_config=ANSWER_EXTRACTION, parsing_timeout=None)


def extracted_string(parsed: list[Any]) -> str | None:
    """The answer text math-verify extracted (the string it kept), else the parsed value as text."""
    for item in reversed(parsed):
        if isinstance(item, str):
            return item
    return str(parsed[-1]) if parsed else None


def answer_problem(answer: str, question: str = "") -> tuple[str, str | None]:
    """(the answer to grade, None) or (the answer, why it earns nothing without being graded).

    `answer` is the final message's text; what is graded is that text less its `<think>` reasoning, with
    digits of any script made ASCII. Refused: an answer that is only reasoning; a box inside a box;
    several boxes (the last one is the answer only when every box says the same). (math_reward also
    refuses an answer whose expression is copied from the question: "2+2" for "What is 2+2?".)
    """
    text = ascii_digits(without_reasoning(answer))
    if answer.strip() and not text.strip():
        return text, "the answer is only inside <think> reasoning"
    boxes = boxed_contents(text[-MAX_ANSWER_CHARS:])
    if any("\\boxed" in box for box in boxes):
        return text, "a \\boxed{} inside a \\boxed{}"
    if len(boxes) > MAX_BOXES:
        return text, f"more than {MAX_BOXES} boxed answers"
    if len(boxes) > 1:
        last = parse(f"\\boxed{{{boxes[-1]}}}", extraction_config=ANSWER_EXTRACTION, parsing_timeout=None)
        for box in boxes[:-1]:
            if " ".join(box.split()) == " ".join(boxes[-1].split()):
                continue
            other = parse(f"\\boxed{{{box}}}", extraction_config=ANSWER_EXTRACTION, parsing_timeout=None)
            if not (last and other and verify(last, other, timeout_seconds=None)):
                return text, "several boxed answers that disagree"
    return text, None


def copied_from(extracted: str | None, question: str) -> bool:
    """Whether an extracted answer that is more than a bare number appears as it is in the question."""
    if not extracted or not question:
        return False
    compact = "".join(extracted.split())
    if re.fullmatch(r"[-+]?\d+(?:\.\d+)?", compact):
        return False
    return compact in "".join(ascii_digits(question).split())


def math_reward(answer: str, expected: str, question: str = "") -> MathResult:
    """Grade one answer against the gold (blocking: call it off the event loop). Never raises.

    `question` (the task's user text) lets an answer that only restates it be refused: an expression
    (more than a bare number) found as it is in the question is not a computed answer.
    """
    try:
        gold = parse_gold(expected)
        if not gold:
            return MathResult(0.0, {"extracted": None, "reason": GOLD_UNPARSABLE})
        if not answer.strip():
            return MathResult(0.0, {"extracted": None, "reason": "empty answer"})
        text, problem = answer_problem(answer, question)
        if problem:
            return MathResult(0.0, {"extracted": None, "reason": problem})
        predicted = parse_answer(text)
        if not predicted:
            return MathResult(0.0, {"extracted": None, "reason": "no mathematical answer found"})
        extracted = extracted_string(predicted)
        if copied_from(extracted, question):
            return MathResult(0.0, {"extracted": extracted, "reason": "the answer restates the question"})
        correct = verify(gold, predicted, timeout_seconds=None)
        if not correct:
            return MathResult(0.0, {"extracted": extracted, "reason": "not equivalent to the expected answer"})
        return MathResult(1.0, {"extracted": extracted})
    except Exception as exc:  # math-verify swallows most errors; this is the last line of defence
        return MathResult(0.0, {"extracted": None, "reason": f"grading failed: {type(exc).__name__}"})


def question_text(params: Any) -> str:
    """The task's user text (its string input, or its user messages joined)."""
    given = params.input
    if isinstance(given, str):
        return given
    return "\n".join(message_text(item) for item in given if (item.get("role") if isinstance(item, dict)
                                                              else getattr(item, "role", None)) == "user")


def gold_check(expected: str) -> MathResult:
    """1.0 when math-verify can parse the gold answer, else 0.0 with the reason. Never raises."""
    try:
        return MathResult(1.0) if parse_gold(expected) else MathResult(0.0, {"reason": GOLD_UNPARSABLE})
    except Exception as exc:
        return MathResult(0.0, {"reason": f"parsing failed: {type(exc).__name__}"})


async def run_with_deadline(
    pool: concurrent.futures.Executor, timeout_s: float, fn: Callable[..., MathResult], *args: Any
) -> MathResult:
    """`fn(*args)` in `pool`, or reward 0.0 with reason "timeout" when it overruns `timeout_s`.

    A thread cannot be killed: an overrunning call keeps its worker until it finishes, so the pool
    is bounded and a slow answer costs at most one worker, not the event loop.
    """
    future = asyncio.get_running_loop().run_in_executor(pool, fn, *args)
    try:
        return await asyncio.wait_for(future, timeout_s)
    except asyncio.TimeoutError:
        return MathResult(0.0, {"extracted": None, "reason": "timeout"})


class MathServer(ResourcesServer):
    task_model = MathTask
    config_class = MathServerConfig

    def __init__(self, config: MathServerConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.grading_workers, thread_name_prefix="math-verify"
        )

    async def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        await super().shutdown()

    async def _check_gold(self, expected: str) -> None:
        """A gold answer math-verify cannot parse is a bad task row: 422 naming the field.

        A check that overruns the deadline (a loaded machine) refuses nothing; /verify decides.
        """
        checked = await run_with_deadline(self.pool, self.config.grading_timeout_s, gold_check, expected)
        if checked.reward == 0.0 and checked.details.get("reason") != "timeout":
            raise BadRequest(f"{expected!r} is not a usable answer: {checked.details['reason']}",
                             field="expected_answer")

    async def seed(self, task: MathTask, state: dict[str, Any]) -> None:
        await self._check_gold(task.expected_answer)

    async def verify(self, request: MathTask, state: dict[str, Any]) -> Verdict:
        output = request.response.output
        answer = final_answer_text(output)
        if not answer.strip() and final_message_text(output).strip():
            # An answer written before a tool call, with none after it, is no final answer.
            return Verdict(reward=0.0, details={"extracted": None, "reason": "no final answer: the response "
                                                "ends with a tool call or its output"})
        result = await run_with_deadline(
            self.pool, self.config.grading_timeout_s, math_reward, answer, request.expected_answer,
            question_text(request.responses_create_params),
        )
        if result.details.get("reason") == GOLD_UNPARSABLE:  # seed refuses such rows; so does verify
            raise BadRequest(f"{request.expected_answer!r} is not a usable answer", field="expected_answer")
        return Verdict(reward=result.reward, details=result.details)
