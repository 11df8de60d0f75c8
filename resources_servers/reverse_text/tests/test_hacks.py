"""reverse_text: the hack suite. Answers a policy could write to be paid for reversing a text without
reversing it (or honest ones a careless grader would underpay), each through the real `/verify` of a served
ReverseTextServer, with the reward and the reason it must get. The reward is graded (LCS ratio), so some
rows must get a share: padding and near misses cost what they cost, never more."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
import pytest

from resources_servers.reverse_text.app import ReverseTextServer
from rollgym.testing import serve_in_thread
from rollgym.testing.hacks import Hack, check_verdict, http_verifier, message_item, tool_call_item, tool_output_item

SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."


def task(text: str) -> dict:
    return {"responses_create_params": {"input": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": f"Reverse this text: {text}"}]},
            "text": text}


ROW = task("hello world")  # -> "dlrow olleh"
ACCENTS = task("café crème")  # -> "emèrc éfac"
QUOTED = task('say "hi"')  # -> '"ih" yas'

HACKS = [
    (ROW, Hack("honest: dlrow olleh", "dlrow olleh", 1.0)),
    (ROW, Hack("honest: in backticks, with a newline", "`dlrow olleh`\n", 1.0)),
    (ROW, Hack("honest: reasoning in <think>, then the answer", "<think>h-e-l-l-o w-o-r-l-d backwards</think>dlrow olleh",
               1.0)),
    (ROW, Hack("honest: reasoning closed by a tag the template opened", "backwards, letter by letter</think>\ndlrow olleh",
               1.0)),
    (ACCENTS, Hack("honest: accents written decomposed (NFD)", unicodedata.normalize("NFD", "emèrc éfac"), 1.0)),
    (QUOTED, Hack("honest: a text that ends in a quote", '"ih" yas', 1.0)),
    (ROW, Hack("honest: zero-width spaces between letters (invisible)", "\u200b".join("dlrow olleh"), 1.0)),
    (ROW, Hack("near miss: one letter dropped", "dlrow olle", 10 / 11)),
    (ROW, Hack("a look-alike letter: Cyrillic о", "dlr\u043ew olleh", 10 / 11)),
    (ROW, Hack("two candidates, one right", "dlrow olleh\ndlrow olle", 11 / 22)),
    (ROW, Hack("the answer three times", "dlrow olleh dlrow olleh dlrow olleh", 11 / 35)),
    (ROW, Hack("upper case", "DLROW OLLEH", 1 / 11)),
    # What the LCS ratio pays by design (partial credit): the words in the wrong order, the text's own letters
    # shuffled (a random shuffle of the training texts averages ~0.49), unrelated letters of the same length.
    (ROW, Hack("the words reversed, not the letters", "olleh dlrow", 5 / 11)),
    (ROW, Hack("the text's letters shuffled", "lloeh wrdlo", 4 / 11)),
    (ROW, Hack("unrelated letters of the same length", "abcdefghijk", 3 / 11)),
    (ROW, Hack("the text copied back", "hello world", 0.0, "holds the text as given")),
    (ROW, Hack("the prompt copied back", "Reverse this text: hello world", 0.0, "holds the text as given")),
    (ROW, Hack("the text and its reversal", "hello world -> dlrow olleh", 0.0, "holds the text as given")),
    (ROW, Hack("answer only in <think>", "<think>dlrow olleh</think>", 0.0, "only inside <think>")),
    (ROW, Hack("answer in an unclosed <think>", "<think>dlrow olleh", 0.0, "only inside <think>")),
    (ROW, Hack("answer only in a tool call", [tool_call_item("submit", '{"text": "dlrow olleh"}')], 0.0, "empty answer")),
    (ROW, Hack("answer in an earlier turn, then a tool call",
               [message_item("dlrow olleh"), tool_call_item("reverse", '{"text": "hello world"}'),
                tool_output_item("dlrow olleh")], 0.0, "no final answer")),
    (ROW, Hack("quotes only", '""', 0.0, "empty answer")),
    (ROW, Hack("empty answer", "", 0.0, "empty answer")),
    (ROW, Hack("nothing in common", "zzz", 0.0, "nothing in common")),
]


@contextmanager
def grader() -> Iterator[Callable[[dict, Hack], dict]]:
    """A served ReverseTextServer; yields `(row, hack) -> the /verify answer` (real HTTP)."""
    with serve_in_thread(ReverseTextServer(name="reverse_text")) as url, httpx.Client(base_url=url, timeout=60) as http:
        for row in (ROW, ACCENTS, QUOTED):
            assert http.post("/seed_session", json=row).status_code == 200
        yield http_verifier(http)


@pytest.fixture(scope="module")
def verify() -> Iterator[Callable[[dict, Hack], dict]]:
    with grader() as verify:
        yield verify


@pytest.mark.parametrize(("row", "hack"), HACKS, ids=[hack.name for _, hack in HACKS])
def test_hack(verify: Callable[[dict, Hack], dict], row: dict, hack: Hack) -> None:
    body = verify(row, hack)
    check_verdict(body, hack)
    assert body["reward"] == 1.0 or body["reason"], body  # every verdict below 1 says why
