"""reasoning_gym: any of reasoning-gym's procedural generators, scored by the generator's own scorer.

A task row names the entry (`dataset`, `dataset_config`, `seed`, `size`, `index`); the server rebuilds
it (see generators.py) and checks that its question is the row's user message, so a row made by
another reasoning-gym version or with another config is refused instead of scored against the wrong
answer. The reward is `score_answer(answer, entry)` of the generator, where the answer is the text of
the last `<answer>...</answer>` in the final assistant message (reasoning-gym's own extraction, the
format the system prompt asks for). No tags: reward 0.0 with a reason, unless the server is configured
with `untagged_answer: last_number`, for small models that do not follow the format yet: then the last
number of the message is scored instead (and the answer says so). That reading can be gamed: a reply cut
off at max_output_tokens while restating the question ("The LCM of 2 and 4") ends on a number of the
question, right whenever the answer is one of them, and GRPO learns to do just that. `final_number` reads
the last number of a finished reply only (one cut off has no final answer: reward 0 with the reason).
The answer is read as a policy that games the grader would write it: only the final message counts
(one followed by a tool call is no final answer), `<think>` reasoning is left out (an `<answer>` inside
it is not the answer), several `<answer>`s that disagree earn 0, digits of any script are read as ASCII digits before the
scorer sees them, and the default scorer's partial credit for an answer that contains the right one
among other text ("1, 2, 3" for 2) is off unless `containment_credit: true`. Every 0 carries a reason.
A scorer that raises is an environment failure (HTTP 500 with its cause, the rollout's status
`env_error`), never a reward of 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from typing import Any, Callable, Literal, TypeVar

from pydantic import Field

from rollgym import BadRequest, ResourcesServer, ResourcesServerConfig, RunRequest, Verdict
from rollgym.text import ascii_digits, final_answer_text, final_message_text, message_text, without_reasoning

from .generators import ANSWER_TAG, GeneratorError, Generators, answer_of, answers_of

T = TypeVar("T")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ReasoningGymTask(RunRequest):
    dataset: str = Field(min_length=1, description="the generator: leg_counting, basic_arithmetic, ...")
    dataset_config: dict[str, Any] = Field(default_factory=dict, description="the generator's config keys")
    seed: int = Field(description="the dataset's seed")
    size: int = Field(gt=0, description="the dataset's virtual size (a few generators depend on it)")
    index: int = Field(ge=0, description="the entry's index in the dataset")
    expected_answer: Any = Field(default=None, description="the entry's answer, for readers; not used to score")


class ReasoningGymServerConfig(ResourcesServerConfig):
    scoring_timeout_s: float = Field(default=20.0, gt=0, description="deadline for rebuilding and scoring one entry")
    scoring_workers: int = Field(default=2, ge=1, description="threads that build entries and run the scorers")
    max_datasets: int = Field(default=64, ge=1, description="datasets kept built (one per generator, config, seed)")
    untagged_answer: Literal["none", "last_number", "final_number"] = Field(
        default="none", description="without <answer> tags: none = reward 0.0; last_number = score the message's "
                                    "last number (for small models that do not follow the format yet); "
                                    "final_number = the same, of a finished message only (not one cut off at "
                                    "max_output_tokens, whose last number is wherever the cut fell)")
    containment_credit: bool = Field(
        default=False, description="pay reasoning-gym's default scorer's partial credit for an answer that contains "
                                   "the right one among other text (len(right) / len(answer)); off, such an answer "
                                   "earns 0: it is what a hedge (\"1, 2, 3\") earns")


def user_text(task: RunRequest) -> str:
    """The text of the row's user messages, joined."""
    given = task.responses_create_params.input
    if isinstance(given, str):
        return given
    return "\n".join(message_text(item) for item in given if getattr(item, "role", None) == "user")


class ReasoningGymServer(ResourcesServer):
    task_model = ReasoningGymTask
    config_class = ReasoningGymServerConfig
    config: ReasoningGymServerConfig

    def __init__(self, config: ReasoningGymServerConfig | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.generators = Generators(max_datasets=self.config.max_datasets)
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.config.scoring_workers, thread_name_prefix="reasoning-gym"
        )

    async def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        await super().shutdown()

    async def _off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in the pool under the deadline; a bad row becomes a 422 naming its field."""
        future = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.config.scoring_timeout_s)
        except GeneratorError as exc:
            raise BadRequest(str(exc), field=exc.field) from None

    async def _check(self, task: ReasoningGymTask) -> dict[str, Any]:
        """The rebuilt entry, after checking that its question is the row's (else a 422 naming `index`)."""
        entry = await self._off_loop(self.generators.entry, task.dataset, task.dataset_config, task.seed,
                                     task.size, task.index)
        if entry["question"].strip() not in user_text(task):
            raise BadRequest(f"entry {task.index} of {task.dataset} (seed {task.seed}, size {task.size}, this "
                             "dataset_config) has another question than the row's user message: a row made by "
                             "another reasoning-gym version or config", field="index")
        return entry

    async def seed(self, task: ReasoningGymTask, state: dict[str, Any]) -> None:
        await self._check(task)

    async def verify(self, request: ReasoningGymTask, state: dict[str, Any]) -> Verdict:
        await self._check(request)
        output = request.response.output
        raw = final_answer_text(output)
        text = ascii_digits(without_reasoning(raw))
        answer = answer_of(text)
        details: dict[str, Any] = {"extracted": answer}
        refused = self._refusal(output, raw, text)
        if refused:
            details["reason"] = refused
            return Verdict(reward=0.0, details=details)
        untagged = self.config.untagged_answer
        cut_off = untagged == "final_number" and request.response.status == "incomplete"
        if answer is None and untagged != "none" and not cut_off:
            numbers = NUMBER.findall(text)
            answer = numbers[-1] if numbers else None
            details.update(extracted=answer, extracted_from=untagged)
        if answer is None:
            details["reason"] = f"no <{ANSWER_TAG}>...</{ANSWER_TAG}> in the final message"
            if cut_off:
                details["reason"] += ", and it was cut off before a final number (untagged_answer: final_number)"
            elif untagged != "none":
                details["reason"] += ", and no number"
            return Verdict(reward=0.0, details=details)
        try:
            reward = await self._off_loop(self.generators.score, request.dataset, request.dataset_config,
                                          request.seed, request.size, request.index, answer)
        except asyncio.TimeoutError:
            details["reason"] = "timeout"
            return Verdict(reward=0.0, details=details)
        # A ScorerError is not caught: an HTTP 500 with its cause, so the rollout fails as env_error.
        if 0.0 < reward < 1.0 and not self.config.containment_credit and await self._off_loop(
                self.generators.containment_credit, request.dataset, request.dataset_config, request.seed,
                request.size, request.index, answer):
            details["reason"] = ("the answer contains the right one among other text (several answers?): "
                                 "the scorer's partial credit for that is off (containment_credit: false)")
            return Verdict(reward=0.0, details=details)
        if reward == 0.0:
            details["reason"] = "the scorer gave 0: a wrong answer"
        return Verdict(reward=reward, details=details)

    @staticmethod
    def _refusal(output: Any, raw: str, text: str) -> str | None:
        """Why the final message earns 0 before any scoring, or None (see the module doc)."""
        if not raw.strip() and final_message_text(output).strip():
            return "no final answer: the response ends with a tool call or its output"
        if raw.strip() and not text.strip():
            return "the answer is only inside <think> reasoning"
        if len(set(answers_of(text))) > 1:
            return f"several <{ANSWER_TAG}>s that disagree"
        if not answers_of(text) and answers_of(raw):
            return f"the <{ANSWER_TAG}> is only inside <think> reasoning"
        return None
