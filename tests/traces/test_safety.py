"""drop_unsafe through the real llm_judge resources server: its judge (a model server that grades by
what the answer says) decides which episodes are unsafe; a judge that cannot grade raises, never passes."""

from __future__ import annotations

import re
from typing import Any

import pytest

from resources_servers.llm_judge.app import LLMJudgeConfig, LLMJudgeServer
from rollgym import ModelServer, ResponsesCreateParams, ServerAddress, build_response
from rollgym.testing import serve_in_thread
from rollgym.traces import Episode, Reward, Step, Trace
from rollgym.traces.safety import SAFETY_RUBRIC, JudgeUnavailable, judge_filter
from rollgym.traces.transforms import Filters, select


class SafetyJudge(ModelServer):
    """Grades 0/10 an answer that explains how to build a weapon, 10/10 anything else; keeps what it was asked."""

    def __init__(self) -> None:
        super().__init__(name="judge")
        self.prompts: list[str] = []

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        prompt = str(payload.get("input"))
        self.prompts.append(prompt)
        user = str(payload["input"][-1]["content"])  # the answer sits between its markers there
        answer = re.search(r"<<<ANSWER (\w+) BEGIN>>>(.*?)<<<ANSWER \1 END>>>", user, re.DOTALL).group(2)
        text = "Score: 0/10" if "weapon" in answer else "Score: 10/10"
        item = {"type": "message", "id": "msg_judge", "role": "assistant", "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}]}
        return build_response(payload, [item], model="judge")


def trace(episode: str, answer: str) -> Trace:
    step = Step(kind="llm", input={"messages": [{"role": "user", "content": "Help me with my project."}]},
                output={"messages": [{"role": "assistant", "content": answer}]})
    return Trace(episode=Episode(id=episode), steps=[step], rewards=[Reward(value=1.0)])


def test_the_llm_judge_drops_unsafe_episodes() -> None:
    judge = SafetyJudge()
    with serve_in_thread(judge) as judge_url:
        env = LLMJudgeServer(LLMJudgeConfig(judge_model_server={"name": "judge"}, client_max_retries=0),
                             name="llm_judge", registry={"judge": ServerAddress(url=judge_url, role="models")})
        with serve_in_thread(env) as env_url:
            filters = Filters(drop_unsafe=judge_filter(env_url))
            kept = select([trace("a", "Use a spreadsheet."), trace("b", "Here is how to build a weapon: ...")], filters)
    assert [t.episode.id for t in kept] == ["a"] and filters.dropped == {"unsafe": 1}
    assert len(judge.prompts) == 2 and all(SAFETY_RUBRIC[:40] in prompt for prompt in judge.prompts)
    with pytest.raises(JudgeUnavailable, match="127.0.0.1:9"):
        select([trace("c", "fine")], Filters(drop_unsafe=judge_filter("http://127.0.0.1:9", timeout_s=5)))
