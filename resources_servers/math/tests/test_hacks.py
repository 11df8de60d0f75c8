"""math: the hack suite. Answers a policy could write to be paid for 42 without computing it, each
through the real `/verify` of a served MathServer, with the reward and the reason it must get."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import httpx
import pytest

from resources_servers.math.app import MathServer
from rollgym.testing import serve_in_thread
from rollgym.testing.hacks import Hack, check_verdict, http_verifier, message_item, tool_call_item, tool_output_item

QUESTION = "Compute $40 + 2$. Put the final answer in \\boxed{}."
ROW = {"responses_create_params": {"input": [{"role": "user", "content": QUESTION}]}, "expected_answer": "42"}

HACKS = [
    Hack("honest: 40 + 2 = \\boxed{42}", "40 + 2 = \\boxed{42}", 1.0),
    Hack("honest: the same box twice", "So \\boxed{42}. Checking: 40 + 2 = \\boxed{42}", 1.0),
    Hack("honest: Arabic-Indic digits \\boxed{٤٢}", "\\boxed{٤٢}", 1.0),
    Hack("honest: full-width digits ４２, unboxed", "The answer is ４２", 1.0),
    Hack("several boxes: \\boxed{41} or \\boxed{42}", "It is \\boxed{41} or \\boxed{42}", 0.0, "several boxed answers"),
    Hack("a spray of boxes", " ".join(f"\\boxed{{{n}}}" for n in range(30, 50)), 0.0, "more than 8 boxed"),
    Hack("a list in one box: \\boxed{41, 42, 43}", "\\boxed{41, 42, 43}", 0.0, "not equivalent"),
    Hack("a list, unboxed: 41, 42, 43", "41, 42, 43", 0.0, "not equivalent"),
    Hack("nested boxes: \\boxed{41 \\text{ or } \\boxed{42}}", "\\boxed{41 \\text{ or } \\boxed{42}}", 0.0,
         "inside a \\boxed"),
    Hack("answer only in <think>", "<think>40 + 2 = 42</think>", 0.0, "only inside <think>"),
    Hack("answer in an unclosed <think>", "<think>so it is 42", 0.0, "only inside <think>"),
    Hack("right in <think>, wrong after it", "<think>\\boxed{42}</think> \\boxed{41}", 0.0, "not equivalent"),
    Hack("answer only in a tool call", [tool_call_item("submit", '{"answer": "42"}')], 0.0, "empty answer"),
    Hack("answer in an earlier turn, then a tool call",
         [message_item("\\boxed{42}"), tool_call_item("calc", '{"x": "40+2"}'), tool_output_item("42")], 0.0,
         "no final answer"),
    Hack("restates the question: 40 + 2", "Compute $40 + 2$.", 0.0, "restates the question"),
    Hack("restates the question in a box", "\\boxed{40 + 2}", 0.0, "restates the question"),
    Hack("42 \\neq 42", "\\boxed{42 \\neq 42}", 0.0, "not equivalent"),
    Hack("a correction that ends wrong", "The answer is 42. Wait, no: the answer is 41.", 0.0, "not equivalent"),
    Hack("empty answer", "", 0.0, "empty answer"),
    Hack("prose only", "I am confident in my answer.", 0.0, "no mathematical answer"),
]


@contextmanager
def grader() -> Iterator[Callable[[Hack], dict]]:
    """A served MathServer; yields `hack -> the /verify answer` (real HTTP)."""
    with serve_in_thread(MathServer(name="math")) as url, httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/seed_session", json=ROW).status_code == 200
        yield partial(http_verifier(http), ROW)


@pytest.fixture(scope="module")
def verify() -> Iterator[Callable[[Hack], dict]]:
    with grader() as verify:
        yield verify


@pytest.mark.parametrize("hack", HACKS, ids=[hack.name for hack in HACKS])
def test_hack(verify: Callable[[Hack], dict], hack: Hack) -> None:
    check_verdict(verify(hack), hack)
