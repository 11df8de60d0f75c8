"""A weather agent that manages its own context, as OpenHands' summarising condenser (or Claude Code's and
Codex's compaction) does: once its history holds K model turns since the last compaction
(`COMPACT_AFTER`, default 1, so that even a short task shows it), it has the model summarise the
conversation in a call of its own (a summariser prompt with the transcript as text), then goes on from
[system, task, the summary, its last turn kept verbatim] instead of the whole history. The last turn is
kept so that a tool call and its result stay together, as chat APIs require.

    echo '{"question": "What is the weather in Paris?"}' | python agent.py

Plain `openai` SDK, configured only by OPENAI_BASE_URL / OPENAI_API_KEY (and OPENAI_MODEL). Reads a
task as JSON on stdin (a rollgym weather row, or {"question": ...}); prints the answer. The tool asks
ROLLGYM_TOOLS_URL (the environment, under the proxy) when it is set, else a small table.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import httpx
from openai import OpenAI

MODEL = os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
COMPACT_AFTER = int(os.environ.get("COMPACT_AFTER", "1"))
MAX_TURNS = 4  # model turns that work on the task (summaries not counted)
SYSTEM = "You are a weather assistant. Use get_weather, then answer with the condition and the temperature."
SUMMARISER = "You summarise an assistant's conversations for it to go on from."
SUMMARISE = "Summarise this conversation in one sentence: what was asked and what was found.\n\n"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}]
LOCAL = {"paris": "Paris: sunny, 22 C", "london": "London: rainy, 14 C"}


def get_weather(arguments: str) -> str:
    tools_url = os.environ.get("ROLLGYM_TOOLS_URL")
    if tools_url:
        reply = httpx.post(f"{tools_url}/get_weather", content=arguments, timeout=60,
                           headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}",
                                    "Content-Type": "application/json"})
        return reply.text
    try:
        city = str(json.loads(arguments).get("city", ""))
    except (ValueError, AttributeError):
        return "Error: arguments must be a JSON object with 'city'."
    return LOCAL.get(city.strip().lower(), f"No weather data for {city}.")


def question(task: dict[str, Any]) -> str:
    if "question" in task:
        return task["question"]
    items = task["responses_create_params"]["input"]
    return items if isinstance(items, str) else [i for i in items if i.get("role") == "user"][-1]["content"]


def transcript(messages: list[dict[str, Any]]) -> str:
    lines = []
    for message in messages:
        calls = [f"{c['function']['name']}({c['function']['arguments']})" for c in message.get("tool_calls") or []]
        lines.append(f"{message['role']}: {' '.join([message.get('content') or '', *calls]).strip()}")
    return "\n".join(lines)


def compact(client: OpenAI, head: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history replaced by the model's summary of it, followed by its last turn (the last assistant
    message and the tool results that answer it)."""
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=48,
        messages=[{"role": "system", "content": SUMMARISER},
                  {"role": "user", "content": SUMMARISE + transcript([*head[1:], *history])}])
    summary = completion.choices[0].message.content or ""
    last = max(i for i, message in enumerate(history) if message["role"] == "assistant")
    return [{"role": "user", "content": f"Summary of the conversation so far: {summary}"}, *history[last:]]


def main() -> None:
    client = OpenAI()
    head = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question(json.load(sys.stdin))}]
    history: list[dict[str, Any]] = []
    since = 0  # model turns in the history since the last compaction
    for turn in range(MAX_TURNS):
        if since >= COMPACT_AFTER:
            history, since = compact(client, head, history), 0
        completion = client.chat.completions.create(
            model=MODEL, messages=[*head, *history], tools=TOOLS, max_tokens=64,
            tool_choice="required" if turn == 0 else "auto")
        message = completion.choices[0].message
        history.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        since += 1
        if not message.tool_calls:
            print(message.content or "")
            return
        for call in message.tool_calls:
            output = get_weather(call.function.arguments) if call.function.name == "get_weather" \
                else f"Error: unknown tool {call.function.name}"
            history.append({"role": "tool", "tool_call_id": call.id, "content": output})
    print(history[-1].get("content") or "")


if __name__ == "__main__":
    main()
