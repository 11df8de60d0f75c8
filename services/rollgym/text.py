"""Reading text out of Responses items, for reward functions."""

from __future__ import annotations

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
