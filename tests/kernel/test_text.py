"""rollgym.text: reading the final answer out of a response as a grader that a policy games must."""

from __future__ import annotations

import pytest

from rollgym.text import ascii_digits, boxed_contents, final_answer_text, final_message_text, without_reasoning
from rollgym.testing.hacks import message_item, tool_call_item, tool_output_item


def test_final_answer_is_the_message_no_tool_call_follows() -> None:
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": []}
    answered = [message_item("first"), tool_call_item("f", "{}"), tool_output_item("x"), reasoning, message_item("last")]
    assert final_answer_text(answered) == "last"
    assert final_answer_text([message_item("answer"), reasoning]) == "answer"  # reasoning after it is fine
    before_a_call = [message_item("a guess"), tool_call_item("f", "{}")]
    assert final_answer_text(before_a_call) == "" and final_message_text(before_a_call) == "a guess"
    assert final_answer_text([message_item("a guess"), tool_call_item("f", "{}"), tool_output_item("x")]) == ""
    assert final_answer_text([]) == ""


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<think>it is 42</think>The answer is 41.", "The answer is 41."),
        ("<think>42</think>", ""),
        ("Before <THINKING>x</THINKING> after", "Before  after"),
        ("So <think>unclosed 42", "So "),  # cut off while thinking: no answer
        ("reasoning from a template that opened the block </think> 7", " 7"),
        ("no reasoning", "no reasoning"),
    ],
)
def test_without_reasoning(text: str, answer: str) -> None:
    assert without_reasoning(text) == answer


def test_ascii_digits_reads_every_script_and_leaves_superscripts() -> None:
    assert ascii_digits("٤٢ ４２ ४२ ۴۲ 42") == "42 42 42 42 42"
    assert ascii_digits("x² + ½") == "x² + ½"


def test_boxed_contents_are_top_level_and_complete() -> None:
    text = "a \\boxed{3} or \\boxed{\\frac{1}{2}}, \\boxed{x \\boxed{4}} and \\boxed{5"
    assert boxed_contents(text) == ["3", "\\frac{1}{2}", "x \\boxed{4}"]
    assert boxed_contents("none") == []
