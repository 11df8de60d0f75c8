"""llm_judge: score parsing, the judge prompt, and the server over real HTTP with real judge servers.

The judges are rollgym model servers served over HTTP: a real ChatCompletionsModel in front of the
scripted backend (which only echoes, so its replies carry no score), and a tiny ModelServer written
here that answers with scripted judge texts, slowly, or with an HTTP error.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.exceptions import HTTPException

from agents.simple_agent.app import SimpleAgent, SimpleAgentConfig
from models.chat_completions.app import ChatCompletionsConfig, ChatCompletionsModel
from resources_servers.llm_judge.app import (
    JudgeTask,
    LLMJudgeConfig,
    LLMJudgeServer,
    judge_messages,
    parse_score,
    question_text,
)
from rollgym import ModelServer, ResponsesCreateParams, ServerAddress, build_response
from rollgym.schema import RunResponse
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, free_port, scripted_backend, serve_in_thread

ENV = env_folder(__file__)
DATA = ENV.examples
ROWS = ENV.rows()
ROW = ROWS[0]




# --- score parsing -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("The answer is accurate and concise.\nScore: 7/10", 0.7),
        ("Score: 8/10", 0.8),
        ("[[8]]", 0.8),
        ("Verdict: [[6/10]]", 0.6),
        ('{"score": 0.7}', 0.7),
        ('{"reasoning": "ok", "score": 9}', 0.9),
        ('{"score": "7/10"}', 0.7),
        ("**Score:** 9 / 10", 0.9),
        ("Final score = 10", 1.0),
        ("Rating: 3 out of 5", 0.6),
        ("Grade: 85%", 0.85),
        ("score: 0.25", 0.25),
        ("Score: 1.0", 1.0),
        ("Score: 0/10 - wrong answer.", 0.0),
        ("First pass: Score: 2/10. On reflection the answer is right.\nScore: 6/10", 0.6),  # the last one wins
        ("8", 0.8),
        ("7.", 0.7),
        ("Score: 11/10", None),
        ("Score: -1/10", None),
        ("Score: 12", None),
        ("The answer is good.", None),
        ("Score: <an integer from 0 to 10>/10", None),
        ("", None),
        ('{"score": true}', None),
    ],
)
def test_parse_score(text: str, score: float | None) -> None:
    assert parse_score(text, 10) == score


def test_parse_score_other_scale() -> None:
    assert parse_score("Score: 4", 5) == 0.8
    assert parse_score("Score: 4/10", 5) == 0.4  # an explicit denominator wins


def test_judge_prompt() -> None:
    task = JudgeTask.model_validate(ROW)
    assert question_text(task.responses_create_params) == ROW["responses_create_params"]["input"][1]["content"]
    messages = judge_messages("Be right.", "What is 2+2?", "4", "Four.", 10, token="t0")
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    for block in ("<rubric>\nBe right.\n</rubric>", "<question>\nWhat is 2+2?\n</question>",
                  "<reference_answer>\nFour.\n</reference_answer>", "<<<ANSWER t0 BEGIN>>>\n4\n<<<ANSWER t0 END>>>"):
        assert block in user
    assert "<<<ANSWER t0 BEGIN>>> and <<<ANSWER t0 END>>>" in messages[0]["content"]
    assert user.endswith("Score: <an integer from 0 to 10>/10")
    assert "against the rubric and the reference answer" in user
    without = judge_messages("Be right.", "Q", "A", None, 10)[1]["content"]
    assert "<reference_answer>" not in without and "against the rubric." in without
    assert parse_score(user) is None  # the prompt itself reads as no score (an echoing judge scores nothing)


# --- judge servers ----------------------------------------------------------------------------------------


class ScriptedJudge(ModelServer):
    """A judge that answers with scripted texts in order (the last one repeats), optionally slowly or with an HTTP error."""

    def __init__(self, *replies: str, delay_s: float = 0.0, fail_status: int | None = None) -> None:
        super().__init__(name="judge")
        self.replies = deque(replies or ["Score: 5/10"])
        self.delay_s = delay_s
        self.fail_status = fail_status
        self.requests: list[dict[str, Any]] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def responses(self, params: ResponsesCreateParams, payload: dict[str, Any]) -> dict[str, Any]:
        self.requests.append(payload)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            if self.fail_status is not None:
                raise HTTPException(self.fail_status, detail="the judge's backend is down")
            text = self.replies.popleft() if len(self.replies) > 1 else self.replies[0]
            adapter = self.adapter_for(payload)
            if adapter is not None:  # a hot-loaded policy adapter grades everything 0
                text = f"Score: 0/10 (graded by {adapter.name})"
            item = {"type": "message", "id": "msg_judge", "role": "assistant", "status": "completed",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}
            return build_response(payload, [item], model="judge")
        finally:
            self.in_flight -= 1

    async def attach_adapter(self, request: Any) -> Any:
        return request.lora_path


def make_env(judge_url: str, **config: Any) -> LLMJudgeServer:
    config.setdefault("client_max_retries", 0)
    return LLMJudgeServer(
        LLMJudgeConfig(judge_model_server={"name": "judge"}, **config), name="llm_judge",
        registry={"judge": ServerAddress(url=judge_url, role="models")},
    )


@contextmanager
def env_client(judge: ModelServer | str, **config: Any) -> Iterator[httpx.Client]:
    """The environment over HTTP, judged by `judge` (a server to run, or the URL of one)."""
    with ExitStack() as stack:
        judge_url = judge if isinstance(judge, str) else stack.enter_context(serve_in_thread(judge))
        url = stack.enter_context(serve_in_thread(make_env(judge_url, **config)))
        yield stack.enter_context(httpx.Client(base_url=url, timeout=30.0))


def answer_in(request: dict[str, Any]) -> str:
    """The answer a judge request shows, between the markers its system prompt names."""
    begin, end = re.search(r"between the lines (\S.*?) and (\S.*?)\. ", request["input"][0]["content"]).groups()
    return request["input"][1]["content"].split(begin, 1)[1].split(end, 1)[0].strip()


def verify(client: httpx.Client, answer: str, row: dict[str, Any] = ROW) -> httpx.Response:
    return client.post("/verify", json={**row, "response": final_response(answer)})


# --- rewards -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("reply", "reward"), [("Good.\nScore: 8/10", 0.8), ("[[7]]", 0.7), ('{"score": 0.7}', 0.7),
                                               ("Score: 0/10", 0.0)])
def test_scores_become_rewards(reply: str, reward: float) -> None:
    judge = ScriptedJudge(reply)
    with env_client(judge) as client:
        assert client.post("/seed_session", json=ROW).status_code == 200
        result = verify(client, "Rayleigh scattering makes blue light scatter most.")
        assert result.status_code == 200, result.text
        body = result.json()
    assert body["reward"] == reward and body["reward_components"] == {"judge_score": reward}
    assert body["judge_output"] == reply and body["judge_attempts"] == 1
    # What the judge was asked: the rubric, the question, the reference and the answer.
    request = judge.requests[0]
    assert request["temperature"] == 0.0 and request["max_output_tokens"] == 1024
    assert request["model"] == "judge"  # its base model, by name: a hot-loaded adapter never judges
    prompt = request["input"][1]["content"]
    assert ROW["rubric"] in prompt and ROW["reference_answer"] in prompt
    assert answer_in(request) == "Rayleigh scattering makes blue light scatter most."


def test_unparsable_reply_is_reasked_once() -> None:
    judge = ScriptedJudge("I like it a lot!", "Score: 6/10")
    with env_client(judge, judge_model="judge-large") as client:
        body = verify(client, "Blue light scatters more.").json()
    assert body["reward"] == 0.6 and body["judge_attempts"] == 2
    second = judge.requests[1]
    assert second["model"] == "judge-large"
    assert [m["role"] for m in second["input"]] == ["system", "user", "assistant", "user"]
    assert second["input"][2]["content"] == "I like it a lot!"
    assert "Score: <an integer from 0 to 10>/10" in second["input"][3]["content"]


def test_empty_answer_is_zero_without_the_judge() -> None:
    judge = ScriptedJudge("Score: 9/10")
    with env_client(judge) as client:
        body = verify(client, "   ").json()
    assert body["reward"] == 0.0 and body["judge_skipped"] == "the response has no final answer"
    assert judge.requests == []


def test_rows_without_rubric_are_422() -> None:
    with env_client(ScriptedJudge()) as client:
        row = {k: v for k, v in ROW.items() if k != "rubric"}
        reply = client.post("/seed_session", json=row)
        assert reply.status_code == 422 and reply.json()["error"]["field"] == "rubric"
        for row in ROWS:
            assert client.post("/seed_session", json=row).status_code == 200
            assert verify(client, "An answer.", row).json()["reward"] == 0.5


# --- judge failures: a 5xx, never a reward --------------------------------------------------------------------


def assert_judge_failure(reply: httpx.Response, status: int, *fragments: str) -> None:
    assert reply.status_code == status, reply.text
    message = reply.json()["error"]["message"]
    assert message.startswith("judge failed: ")
    for fragment in fragments:
        assert fragment in message, message


def test_garbage_after_retries_is_502() -> None:
    judge = ScriptedJudge("What a lovely answer.")
    with env_client(judge, judge_parse_retries=2) as client:
        reply = verify(client, "Blue.")
    assert_judge_failure(reply, 502, "no score in the judge's reply after 3 attempt(s)", "What a lovely answer.")
    assert len(judge.requests) == 3


def test_echoing_chat_completions_judge_is_502() -> None:
    # A real ChatCompletionsModel in front of the scripted backend: it echoes the judge prompt back.
    with scripted_backend() as backend:
        judge = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted", max_retries=0), name="judge")
        with env_client(judge, judge_parse_retries=0) as client:
            reply = verify(client, "Blue light scatters more.")
    assert_judge_failure(reply, 502, "no score in the judge's reply after 1 attempt(s)",
                         "You said: Grade the answer below.")


def test_slow_judge_times_out_with_504() -> None:
    judge = ScriptedJudge("Score: 9/10", delay_s=1.5)
    with env_client(judge, judge_timeout_s=0.3) as client:
        started = time.monotonic()
        reply = verify(client, "Blue.")
        elapsed = time.monotonic() - started
        time.sleep(1.3)  # let the judge's sleeping handler finish before it shuts down
    assert_judge_failure(reply, 504, "within judge_timeout_s=0.3 s")
    assert elapsed < 1.2


def test_judge_http_error_is_502() -> None:
    with env_client(ScriptedJudge(fail_status=503)) as client:
        reply = verify(client, "Blue.")
    assert_judge_failure(reply, 502, "answered HTTP 503", "the judge's backend is down")


def test_unreachable_judge_is_502() -> None:
    with env_client(f"http://127.0.0.1:{free_port()}") as client:
        reply = verify(client, "Blue.")
    assert_judge_failure(reply, 502, "judge server unavailable", "connect")


def test_judge_concurrency_is_bounded() -> None:
    judge = ScriptedJudge("Score: 10/10", delay_s=0.15)
    with env_client(judge, max_concurrent_judgements=2) as client:
        with ThreadPoolExecutor(max_workers=6) as pool:
            replies = list(pool.map(lambda _: verify(client, "Blue."), range(6)))
    assert [r.json()["reward"] for r in replies] == [1.0] * 6
    assert judge.max_in_flight == 2


# --- full rollouts through the real agent ---------------------------------------------------------------------


@contextmanager
def agent_client(policy_url: str, env_url: str) -> Iterator[httpx.Client]:
    agent = SimpleAgent(
        SimpleAgentConfig(model_server={"name": "policy_model"}, resources_server={"name": "llm_judge"}, max_steps=2),
        name="agent",
        registry={"policy_model": ServerAddress(url=policy_url, role="models"),
                  "llm_judge": ServerAddress(url=env_url, role="resources_servers")},
    )
    with serve_in_thread(agent) as url, httpx.Client(base_url=url, timeout=30.0) as http:
        yield http


@pytest.fixture(scope="module")
def policy_url() -> Iterator[str]:
    with scripted_backend() as backend:
        model = ChatCompletionsModel(ChatCompletionsConfig(base_url=backend, model="scripted"), name="policy_model")
        with serve_in_thread(model) as url:
            yield url


def test_rollout_is_judged(policy_url: str) -> None:
    judge = ScriptedJudge("Clear and correct.\nScore: 8/10")
    with ExitStack() as stack:
        judge_url = stack.enter_context(serve_in_thread(judge))
        env_url = stack.enter_context(serve_in_thread(make_env(judge_url)))
        client = stack.enter_context(agent_client(policy_url, env_url))
        reply = client.post("/run", json={**ROW, "rollout_id": "r-ok"})
    assert reply.status_code == 200, reply.text
    result = reply.json()
    RunResponse.model_validate(result)
    assert result["status"] == "ok" and result["reward"] == 0.8 and result["error"] is None
    # The scripted policy echoes the question; that is the answer the judge saw.
    assert answer_in(judge.requests[0]) == f"You said: {ROW['responses_create_params']['input'][1]['content']}"


@pytest.mark.parametrize("follows", [False, True])
def test_the_judge_keeps_its_weights_when_the_policy_adapter_is_loaded_on_its_server(follows: bool,
                                                                                    tmp_path: Path) -> None:
    """The judge and the policy share a model server; a trainer hot-loads the policy's adapter there.
    The judge names its base model in every request and so still judges with the base weights, unless
    the config says it follows the policy."""
    judge = ScriptedJudge("Score: 8/10")
    with serve_in_thread(judge) as judge_url, env_client(judge_url, judge_follows_policy=follows) as client:
        assert verify(client, "Paris").json()["reward"] == 0.8
        loaded = httpx.post(f"{judge_url}/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(tmp_path)})
        assert loaded.status_code == 200, loaded.text
        after = verify(client, "Paris").json()
    assert after["reward"] == (0.0 if follows else 0.8)
    assert [request.get("model") for request in judge.requests] == ([None, None] if follows else ["judge", "judge"])


def test_rollout_with_a_dead_judge_is_env_error(policy_url: str) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        env_url = stack.enter_context(serve_in_thread(make_env(dead)))
        client = stack.enter_context(agent_client(policy_url, env_url))
        reply = client.post("/run", json={**ROW, "rollout_id": "r-dead"})
    assert reply.status_code == 200, reply.text
    result = reply.json()
    RunResponse.model_validate(result)
    assert result["status"] == "env_error"
    assert result["reward"] is None
    assert "/verify answered HTTP 502" in result["error"] and "judge server unavailable" in result["error"]
    assert result["rollout_id"] == "r-dead"
    assert result["response"]["output"][-1]["content"][0]["text"].startswith("You said: ")


# --- config -----------------------------------------------------------------------------------------------------


def test_config_builds_with_the_policy_as_default_judge() -> None:
    server = ENV.build("llm_judge")
    assert isinstance(server, LLMJudgeServer)
    assert server.config.judge_model_server.name == "policy_model"
    assert LLMJudgeConfig().judge_model_server.name == "policy_model"
    agent = ENV.build("llm_judge_agent")
    assert agent.config.tool_timeout_s > server.config.judge_timeout_s
    other = ENV.build("llm_judge", "llm_judge.judge_model_server.name=policy_model", "llm_judge.judge_timeout_s=5")
    assert other.config.judge_timeout_s == 5
