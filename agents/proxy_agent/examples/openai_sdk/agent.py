"""A weather agent on the plain `openai` SDK, streaming: its own tool loop, configured only by the
standard environment variables (OPENAI_BASE_URL, OPENAI_API_KEY), exactly as against OpenAI.

    echo '{"question": "What is the weather in Paris?"}' | python agent.py

Reads a task as JSON on stdin (a rollgym weather row, or {"question": ...}); prints the answer.
The tool asks ROLLGYM_TOOLS_URL (the environment, under the proxy) when it is set, else a table.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
from openai import OpenAI

MODEL = os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
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


def question(task: dict) -> str:
    if "question" in task:
        return task["question"]
    items = task["responses_create_params"]["input"]
    return items if isinstance(items, str) else [i for i in items if i.get("role") == "user"][-1]["content"]


def main() -> None:
    client = OpenAI()
    messages = [{"role": "system", "content": "You are a weather assistant. Use get_weather, then answer with "
                                              "the condition and the temperature."},
                {"role": "user", "content": question(json.load(sys.stdin))}]
    for step in range(4):
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, max_tokens=96, temperature=0.2, stream=True,
            tool_choice="required" if step == 0 else "auto")
        text, calls = "", {}
        for chunk in stream:
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            text += delta.content or ""
            for call in delta.tool_calls or []:
                slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = call.id or slot["id"]
                slot["name"] += (call.function.name or "") if call.function else ""
                slot["arguments"] += (call.function.arguments or "") if call.function else ""
        tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for _, c in sorted(calls.items())]
        messages.append({"role": "assistant", "content": text or None, **({"tool_calls": tool_calls} if tool_calls else {})})
        if not tool_calls:
            print(text)
            return
        for call in tool_calls:
            output = get_weather(call["function"]["arguments"]) if call["function"]["name"] == "get_weather" \
                else f"Error: unknown tool {call['function']['name']}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    print(messages[-1]["content"])


if __name__ == "__main__":
    main()
