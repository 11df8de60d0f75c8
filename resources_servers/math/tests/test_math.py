"""math: the math-verify reward, its deadline, and the server over real HTTP."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time

import httpx
import pytest

from resources_servers.math.app import (
    MathResult,
    MathServer,
    MathServerConfig,
    last_boxed_expression,
    math_reward,
    run_with_deadline,
)
from rollgym.envkit.folder import env_folder
from rollgym.testing import final_response, serve_in_thread

ENV = env_folder(__file__)
DATA = ENV.examples


WRONG = "not equivalent to the expected answer"
DISAGREE = "several boxed answers that disagree"


@pytest.mark.parametrize(
    ("answer", "expected", "reward", "extracted", "reason"),
    [
        ("\\boxed{42}", "42", 1.0, "42", None),
        ("The answer is 0.5", "\\frac{1}{2}", 1.0, "0.5", None),
        ("\\boxed{43}", "42", 0.0, "43", WRONG),
        ("\\frac{2}{4}", "\\frac{1}{2}", 1.0, "\\frac{2}{4}", None),
        ("So $f(x+1) = x^{2}+1$.", "x^2+1", 1.0, "f(x+1) = x^{2}+1", None),
        ("Expanding, we get \\boxed{1 + x^2}.", "x^2+1", 1.0, "1 + x^2", None),
        ("The leg is $\\boxed{\\sqrt{3}}$.", "\\sqrt{3}", 1.0, "\\sqrt{3}", None),
        ("$3x - 7 = 2x + 5$ gives $x = 12$, so \\boxed{12}", "12", 1.0, "12", None),
        # Boxes that disagree are a hedge, whichever comes last; boxes that agree are one answer.
        ("First \\boxed{4}, no wait, \\boxed{6}.", "6", 0.0, None, DISAGREE),
        ("First \\boxed{6}, no wait, \\boxed{4}.", "6", 0.0, None, DISAGREE),
        ("\\boxed{0.5}, that is \\boxed{\\frac{1}{2}}", "0.5", 1.0, "\\frac{1}{2}", None),
        ("\\boxed{\\frac{1}{3}}", "0.5", 0.0, "\\frac{1}{3}", WRONG),
        # math-verify compares values: an unevaluated expression of the answer counts.
        ("\\boxed{6 \\times 7}", "42", 1.0, "6 \\times 7", None),
    ],
)
def test_reward(answer: str, expected: str, reward: float, extracted: str | None, reason: str | None) -> None:
    result = math_reward(answer, expected)
    assert result.reward == reward
    assert result.details == ({"extracted": extracted} if reason is None else {"extracted": extracted, "reason": reason})


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("I don't know", "no mathematical answer found"),
        ("\\boxed{}", "no mathematical answer found"),
        ("   ", "empty answer"),
    ],
)
def test_unparsable_answer_is_zero_with_a_reason(answer: str, reason: str) -> None:
    assert math_reward(answer, "42") == MathResult(0.0, {"extracted": None, "reason": reason})


def test_unparsable_gold_is_reported_not_raised() -> None:
    result = math_reward("\\boxed{1}", "\\frac{")
    assert result.reward == 0.0 and result.details["reason"] == "the expected answer could not be parsed"


def test_last_boxed_expression() -> None:
    assert last_boxed_expression("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\boxed{\\frac{1}{2}}"
    assert last_boxed_expression("\\boxed{7} then \\boxed{8") == "\\boxed{7}"
    assert last_boxed_expression("no box") is None


def test_grading_works_off_the_main_thread() -> None:
    # math-verify's own timeouts use signal.alarm, which raises off the main thread; ours are off.
    results: list[MathResult] = []
    worker = threading.Thread(target=lambda: results.append(math_reward("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}")))
    worker.start()
    worker.join(timeout=30)
    assert results == [MathResult(1.0, {"extracted": "\\frac{2}{4}"})]


def test_deadline_answers_timeout() -> None:
    def slow(answer: str, expected: str) -> MathResult:
        time.sleep(0.2)
        return MathResult(1.0)

    async def main() -> tuple[MathResult, MathResult]:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            late = await run_with_deadline(pool, 0.05, slow, "x", "y")
            on_time = await run_with_deadline(pool, 10.0, math_reward, "\\boxed{42}", "42")
            return late, on_time

    late, on_time = asyncio.run(main())
    assert late == MathResult(0.0, {"extracted": None, "reason": "timeout"})
    assert on_time.reward == 1.0




def test_server_end_to_end_over_http() -> None:
    rows = ENV.rows()
    assert len(rows) == 5
    with serve_in_thread(MathServer(name="math")) as url, httpx.Client(base_url=url) as http:
        assert http.get("/tools").json() == []
        for row in rows:
            assert http.post("/seed_session", json=row).status_code == 200
            good = http.post("/verify", json={**row, "response": final_response(f"... so \\boxed{{{row['expected_answer']}}}")})
            assert good.status_code == 200, good.text
            assert good.json()["reward"] == 1.0 and good.json()["extracted"] is not None
            bad = http.post("/verify", json={**row, "response": final_response("I don't know.")}).json()
            assert bad["reward"] == 0.0 and bad["extracted"] is None and bad["reason"] == "no mathematical answer found"
            wrong = http.post("/verify", json={**row, "response": final_response("\\boxed{1000}")}).json()
            assert wrong["reward"] == 0.0 and wrong["extracted"] == "1000"
        row = rows[1]
        half = http.post("/verify", json={**row, "response": final_response("The answer is 0.5")}).json()
        assert half["reward"] == 1.0
        # Bad task rows: 422 naming the field.
        params = row["responses_create_params"]
        missing = http.post("/seed_session", json={"responses_create_params": params})
        assert missing.status_code == 422 and missing.json()["error"]["field"] == "expected_answer"
        wrong_type = http.post("/seed_session", json={"responses_create_params": params, "expected_answer": ["42"]})
        assert wrong_type.status_code == 422 and wrong_type.json()["error"]["field"] == "expected_answer"
        blank = http.post("/seed_session", json={"responses_create_params": params, "expected_answer": "  "})
        assert blank.status_code == 422 and blank.json()["error"]["field"] == "expected_answer"
        unparsable = {"responses_create_params": params, "expected_answer": "\\frac{"}
        for route in ("/seed_session", "/verify"):
            answer = http.post(route, json={**unparsable, "response": final_response("\\boxed{1}")})
            assert answer.status_code == 422 and answer.json()["error"]["field"] == "expected_answer"
        # A JSON number is accepted as the gold answer.
        number = http.post("/verify", json={"responses_create_params": params, "expected_answer": 42,
                                            "response": final_response("\\boxed{42}")}).json()
        assert number["reward"] == 1.0


def test_timeout_over_http() -> None:
    # One worker, held busy by a stuck grading job: the next answer overruns its deadline and gets
    # 0.0 "timeout" while the server (its event loop) keeps answering.
    server = MathServer(MathServerConfig(grading_timeout_s=0.2, grading_workers=1), name="math")
    row = json.loads(DATA.read_text().splitlines()[0])
    release = threading.Event()
    with serve_in_thread(server) as url, httpx.Client(base_url=url) as http:
        stuck = server.pool.submit(release.wait, 30)
        try:
            answer = http.post("/verify", json={**row, "response": final_response("\\boxed{42}")}).json()
            assert answer["reward"] == 0.0 and answer["extracted"] is None and answer["reason"] == "timeout"
            assert http.get("/health").status_code == 200
        finally:
            release.set()
        stuck.result(timeout=5)
        server.config.grading_timeout_s = 30.0  # a loaded test machine must not time out the check below
        good = final_response(f"\\boxed{{{row['expected_answer']}}}")
        assert http.post("/verify", json={**row, "response": good}).json()["reward"] == 1.0


def test_config_builds_both_servers() -> None:
    env = ENV.build("math")
    assert isinstance(env, MathServer) and env.config.grading_workers == 2
    assert ENV.build("math_agent").config.max_steps == 1
