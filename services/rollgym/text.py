"""Reading text out of Responses items, for reward functions."""

from __future__ import annotations

import re
import unicodedata
from typing import Any, Iterable


def _get(item: Any, key: str, default: Any = None) -> Any:
    return item.get(key, default) if isinstance(item, dict) else getattr(item, key, default)


def message_text(item: Any) -> str:
    """The text of one message item (string content or its text parts joined)."""
    content = _get(item, "content", "")
    if isinstance(content, str):
        return content
    return "".join(str(_get(part, "text", "") or "") for part in content or [])


def final_message_text(output: Iterable[Any]) -> str:
    """The text of the last assistant message in a response's output ("" if there is none)."""
    text = ""
    for item in output:
        if _get(item, "type", "message") == "message" and _get(item, "role") == "assistant":
            text = message_text(item)
    return text


def final_answer_text(output: Iterable[Any]) -> str:
    """The final answer of a response: its last assistant message, when only reasoning follows it.

    Unlike `final_message_text`, a response that ends with a tool call or a tool's output has no final
    answer (""), whatever an earlier turn said: a grader pays for what the model finally answered, not
    for a guess it made before calling a tool.
    """
    text = ""
    for item in output:
        kind = _get(item, "type", "message")
        if kind == "message":
            if _get(item, "role") == "assistant":
                text = message_text(item)
        elif kind != "reasoning":
            text = ""
    return text


# <think>…</think> (and <thinking>, <reasoning>) written into a message's text; an unclosed one runs to the end.
_THINK_BLOCK = re.compile(r"<(think|thinking|reasoning)>.*?(?:</\1>|\Z)", re.DOTALL | re.IGNORECASE)
_THINK_CLOSE = re.compile(r"</(?:think|thinking|reasoning)>", re.IGNORECASE)


def without_reasoning(text: str) -> str:
    """text less the reasoning a model wrote into it: `<think>…</think>` blocks, an unclosed one to the end
    (a reply cut off while thinking has no answer), and everything before a closing tag whose opening
    tag was in the prompt (chat templates that open the block themselves)."""
    text = _THINK_BLOCK.sub("", text)
    closes = list(_THINK_CLOSE.finditer(text))
    return text[closes[-1].end():] if closes else text


def ascii_digits(text: str) -> str:
    """Decimal digits of any script as ASCII ("٤٢", "４２" and "४२" become "42"); other characters, such as
    superscripts ("x²"), are left as they are. A number is the same number whatever its numerals."""
    if text.isascii():
        return text
    return "".join(str(unicodedata.decimal(c)) if c.isdecimal() and not c.isascii() else c for c in text)


def boxed_contents(text: str) -> list[str]:
    """The contents of every complete top-level `\\boxed{...}` of text, in order (a box inside a box is
    part of its content; an unclosed one is skipped)."""
    found: list[str] = []
    start = text.find("\\boxed{")
    while start >= 0:
        depth, end = 0, -1
        for index in range(start + len("\\boxed"), len(text)):
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
                if depth == 0:
                    end = index
                    break
        if end < 0:
            start = text.find("\\boxed{", start + 1)
            continue
        found.append(text[start + len("\\boxed{"):end])
        start = text.find("\\boxed{", end + 1)
    return found


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in text (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    while start >= 0:
        depth = 0
        for index in range(start + len("\\boxed"), len(text)):
            if text[index] == "{":
                depth += 1
            elif text[index] == "}":
                depth -= 1
                if depth == 0:
                    return text[start + len("\\boxed{"):index]
        start = text.rfind("\\boxed{", 0, start)  # unclosed: try the one before
    return None
