"""What the orchestrator's tests share: task rows with known rewards under the scripted policy, and a stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ContextManager

import orjson

from rollgym.client import ServerAddress
from tests.conftest import scripted_stack as shared_scripted_stack

SYSTEM = "You reverse text. Reply with the reversed text only, nothing else."


def reverse_row(word: str, graded_against: str | None = None) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": f"Reverse this text: {word}"}],
                                        "max_output_tokens": 16},
            "text": graded_against or word}


def weather_row(city: str) -> dict[str, Any]:
    tool = {"type": "function", "name": "get_weather", "description": "Get the current weather for a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    return {"responses_create_params": {"input": [{"role": "user", "content": f"What is the weather in {city}?"}],
                                        "tools": [tool]}, "city": city, "expected": ["sunny", "22"]}


def write_rows(path: Path, rows: list[dict[str, Any]]) -> str:
    path.write_bytes(b"".join(orjson.dumps(row) + b"\n" for row in rows))
    return str(path)


def medium_rows(count: int, prefix: str = "m") -> list[dict[str, Any]]:
    """Tasks the scripted policy half-solves (reward 2/3): the difficulty filter keeps them."""
    return [reverse_row(f"{prefix}{i:03d}ab", f"{prefix}{i:03d}xy") for i in range(count)]


def scripted_stack(*backend_flags: str, model_retries: int = 3) -> ContextManager[dict[str, ServerAddress]]:
    """tests/conftest.py's scripted stack, its model server retrying the backend `model_retries` times."""
    return shared_scripted_stack(*backend_flags, max_retries=model_retries)
