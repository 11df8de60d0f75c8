"""A weather agent that hands the lookup to a sub-agent, as Claude Code's Task tool or the OpenAI Agents
SDK's agents-as-tools do. The main agent's one tool is `ask_researcher(task)`: calling it starts a
sub-agent with its own system prompt and its own conversation (a tool loop on `get_weather`), and the
sub-agent's final answer comes back as the tool's result; the main agent then answers the user.

    echo '{"question": "What is the weather in Paris?"}' | python agent.py

Plain `openai` SDK, configured only by OPENAI_BASE_URL / OPENAI_API_KEY (and OPENAI_MODEL); both
agents use the same endpoint. Reads a task as JSON on stdin (a rollgym weather row, or
{"question": ...}); prints the answer. `get_weather` asks ROLLGYM_TOOLS_URL (the environment, under
the proxy) when it is set, else a small table.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable

import httpx
from openai import OpenAI

MODEL = os.environ.get("OPENAI_MODEL", "gpt-4o-mini")
MAX_TURNS = 3  # model turns of each agent
MAIN_SYSTEM = ("You are an assistant. Hand every lookup to the researcher with ask_researcher, then answer the "
               "user with what it found.")
RESEARCHER_SYSTEM = "You are a weather researcher. Use get_weather, then report the condition and the temperature."
ASK_RESEARCHER = {"type": "function", "function": {
    "name": "ask_researcher", "description": "Give a research task to a researcher; returns its findings.",
    "parameters": {"type": "object", "properties": {"task": {"type": "string", "maxLength": 80, "description": "What to find out, in a sentence"}},
                   "required": ["task"]}}}
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"}},
                   "required": ["city"]}}}
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


def tool_loop(client: OpenAI, system: str, request: str, tools: list[dict[str, Any]],
              run_tool: Callable[[str, str], str]) -> str:
    """One agent's conversation: ask (a tool call forced first), run its tool calls, until it answers."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": request}]
    for turn in range(MAX_TURNS):
        completion = client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, max_tokens=64,
            tool_choice="required" if turn == 0 else "auto")
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": run_tool(call.function.name, call.function.arguments)})
    return messages[-1].get("content") or ""


def main() -> None:
    client = OpenAI()
    user_question = question(json.load(sys.stdin))

    def researcher(arguments: str) -> str:
        try:
            task = str(json.loads(arguments).get("task") or "")
        except (ValueError, AttributeError):
            task = ""
        # A call without a task hands over the user's own question.
        return tool_loop(client, RESEARCHER_SYSTEM, task or user_question, [GET_WEATHER],
                         lambda name, args: get_weather(args) if name == "get_weather" else f"Error: unknown tool {name}")

    print(tool_loop(client, MAIN_SYSTEM, user_question, [ASK_RESEARCHER],
                    lambda name, args: researcher(args) if name == "ask_researcher" else f"Error: unknown tool {name}"))


if __name__ == "__main__":
    main()
