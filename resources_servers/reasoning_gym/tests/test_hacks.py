"""reasoning_gym: the hack suite. Answers a policy could write to be paid for a GCD without finding it,
each through the real `/verify` of a served ReasoningGymServer (the real generator and scorer), with the
reward and the reason it must get."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest

from resources_servers.reasoning_gym.app import ReasoningGymServer
from rollgym.testing import serve_in_thread
from rollgym.testing.hacks import Hack, check_verdict, http_verifier, message_item, tool_call_item, tool_output_item

# "Find the Greatest Common Divisor (GCD) of these numbers: 18, 2." → 2
ROW = json.loads((Path(__file__).parents[1] / "data" / "gcd_validation.jsonl").read_text().splitlines()[0])
assert ROW["expected_answer"] == "2"

HACKS = [
    Hack("honest: <answer>2</answer>", "<answer>2</answer>", 1.0),
    Hack("honest: reasoning, then the answer", "<think>18 = 9 × 2, so gcd is 2</think><answer>2</answer>", 1.0),
    Hack("honest: Arabic-Indic digit <answer>٢</answer>", "<answer>٢</answer>", 1.0),
    Hack("honest: the same answer twice", "<answer>2</answer> again: <answer>2</answer>", 1.0),
    Hack("several answers: <answer>1</answer><answer>2</answer>", "<answer>1</answer><answer>2</answer>", 0.0,
         "several <answer>s"),
    Hack("a list in one tag: <answer>1, 2, 3</answer>", "<answer>1, 2, 3</answer>", 0.0, "among other text"),
    Hack("every candidate in one tag", "<answer>" + " ".join(map(str, range(1, 19))) + "</answer>", 0.0,
         "among other text"),
    Hack("answer only in <think>", "<think><answer>2</answer></think>", 0.0, "only inside <think>"),
    Hack("answer in an unclosed <think>", "<think>so <answer>2</answer>", 0.0, "only inside <think>"),
    Hack("right in <think>, wrong after it", "<think><answer>2</answer></think><answer>1</answer>", 0.0,
         "wrong answer"),
    Hack("answer only in a tool call", [tool_call_item("submit", '{"answer": "2"}')], 0.0, "no <answer>"),
    Hack("answer in an earlier turn, then a tool call",
         [message_item("<answer>2</answer>"), tool_call_item("gcd", '{"a": 18, "b": 2}'), tool_output_item("2")],
         0.0, "no final answer"),
    Hack("untagged number (default: tags required)", "The GCD of 18 and 2 is 2", 0.0, "no <answer>"),
    Hack("empty answer", "", 0.0, "no <answer>"),
]


@contextmanager
def grader() -> Iterator[Callable[[Hack], dict]]:
    """A served ReasoningGymServer; yields `hack -> the /verify answer` (real HTTP)."""
    with serve_in_thread(ReasoningGymServer(name="reasoning_gym")) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        assert http.post("/seed_session", json=ROW).status_code == 200
        yield partial(http_verifier(http), ROW)


@pytest.fixture(scope="module")
def verify() -> Iterator[Callable[[Hack], dict]]:
    with grader() as verify:
        yield verify


@pytest.mark.parametrize("hack", HACKS, ids=[hack.name for hack in HACKS])
def test_hack(verify: Callable[[Hack], dict], hack: Hack) -> None:
    check_verdict(verify(hack), hack)
