"""instruction_following: the hack suite. Answers that meet the checks' letter without doing the task,
each through the real `/verify` of a served InstructionFollowingServer, with the reward and the reason
it must get. The checks see only form: what they cannot tell (a fluent answer about something else) is
out of reach here, and the README says so."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from resources_servers.instruction_following.app import InstructionFollowingServer
from rollgym.envkit.folder import env_folder
from rollgym.testing import serve_in_thread
from rollgym.testing.hacks import Hack, check_verdict, http_verifier, message_item, tool_call_item

ROWS = env_folder(__file__).rows()
BOTTLE = ROWS[0]  # lowercase, no commas, 30-80 words, mentions "steel" and "leak-proof"
EXERCISE = ROWS[2]  # exactly 4 bullets, never "easy" or "simple", ends with a fixed question
ENDING = "Is there anything else I can help with?"
BOTTLE_ANSWER = ("this reusable bottle is made of brushed stainless steel and keeps drinks cold for a full day. "
                 "the lid is leak-proof so you can toss it in a bag without worry. it is light to carry and quick "
                 "to clean by hand or in the dishwasher. a wide mouth fits ice cubes and the powder coat resists "
                 "scratches on long hikes.")
EXERCISE_ANSWER = ("* Exercise strengthens the heart and lungs.\n* It lifts your mood and deepens sleep.\n"
                   "* It builds muscle and bone density.\n* It helps you manage your weight over time.\n" + ENDING)

HACKS = [
    (BOTTLE, Hack("honest: a description that meets all four", BOTTLE_ANSWER, 1.0)),
    (EXERCISE, Hack("honest: four bullets and the ending", EXERCISE_ANSWER, 1.0)),
    (BOTTLE, Hack("empty answer (meets no-commas for free)", "", 0.0, "empty answer")),
    (EXERCISE, Hack("empty answer (meets never-say-easy for free)", "   ", 0.0, "empty answer")),
    (BOTTLE, Hack("keyword stuffing to the word count", "steel leak-proof " * 20, 0.0, "repeats a few words")),
    (BOTTLE, Hack("the prompt copied back, lowercased", "write a short product description for a reusable water "
                  "bottle. use only lowercase letters do not use any commas write between 30 and 80 words and "
                  "mention the words steel and leak-proof.", 0.0, "copies the prompt")),
    (EXERCISE, Hack("only the required ending", ENDING, 0.0, "copies the prompt")),
    (EXERCISE, Hack("four one-word bullets and the ending", "* one\n* two\n* three\n* four\n" + ENDING, 0.0,
                    "copies the prompt")),
    (EXERCISE, Hack("a forbidden word with a Cyrillic е", EXERCISE_ANSWER.replace("lungs.", "lungs. It is еasy."),
                    0.0, "look-alike")),
    (EXERCISE, Hack("a forbidden word split by a zero-width space",
                    EXERCISE_ANSWER.replace("lungs.", "lungs. It is ea\u200bsy."), 2 / 3)),
    (BOTTLE, Hack("full-width capitals in an all-lowercase answer", BOTTLE_ANSWER.replace("steel", "ＳＴＥＥＬ"),
                  0.75)),
    (BOTTLE, Hack("the answer before a tool call, none after it",
                  [message_item(BOTTLE_ANSWER), tool_call_item("search", '{"q": "bottles"}')], 0.0,
                  "no final answer")),
    (BOTTLE, Hack("capitals and commas, nothing met", "Steel, Steel, Bottle.", 0.0, "no constraint satisfied")),
]


@contextmanager
def grader() -> Iterator[Callable[[dict, Hack], dict]]:
    """A served InstructionFollowingServer; yields `(row, hack) -> the /verify answer` (real HTTP)."""
    with serve_in_thread(InstructionFollowingServer(name="instruction_following")) as url, \
            httpx.Client(base_url=url, timeout=60) as http:

        yield http_verifier(http)


@pytest.fixture(scope="module")
def verify() -> Iterator[Callable[[dict, Hack], dict]]:
    with grader() as verify:
        yield verify


@pytest.mark.parametrize(("row", "hack"), HACKS, ids=[hack.name for _, hack in HACKS])
def test_hack(verify: Callable[[dict, Hack], dict], row: dict, hack: Hack) -> None:
    check_verdict(verify(row, hack), hack)
