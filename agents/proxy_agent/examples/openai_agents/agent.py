"""An OpenAI Agents SDK weather agent, streamed (the SDK's Responses API path), as written against
OpenAI; under the proxy only OPENAI_BASE_URL / OPENAI_API_KEY (read by the SDK's client) differ.

    echo '{"question": "What is the weather in Paris?"}' | python agent.py

Reads a task as JSON on stdin (a rollgym weather row, or {"question": ...}); prints the answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import httpx
from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled

LOCAL = {"paris": "Paris: sunny, 22 C", "london": "London: rainy, 14 C"}


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    tools_url = os.environ.get("ROLLGYM_TOOLS_URL")
    if tools_url:  # under rollgym: the environment's own tool
        reply = httpx.post(f"{tools_url}/get_weather", json={"city": city}, timeout=60,
                           headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
        return reply.text
    return LOCAL.get(city.strip().lower(), f"No weather data for {city}.")


def question(task: dict) -> str:
    if "question" in task:
        return task["question"]
    items = task["responses_create_params"]["input"]
    return items if isinstance(items, str) else [i for i in items if i.get("role") == "user"][-1]["content"]


async def main() -> None:
    # Traces go to OpenAI's dashboard, which a training cluster neither reaches nor needs.
    set_tracing_disabled(True)
    agent = Agent(
        name="weather", tools=[get_weather], model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"),
        instructions="You are a weather assistant. Use get_weather, then answer with the condition and the temperature.",
        # The SDK resets tool_choice to auto after a tool call, so "required" means "look it up first".
        model_settings=ModelSettings(max_tokens=96, temperature=0.2, tool_choice="required"),
    )
    result = Runner.run_streamed(agent, question(json.load(sys.stdin)), max_turns=6)
    async for _ in result.stream_events():
        pass
    print(result.final_output)


if __name__ == "__main__":
    asyncio.run(main())
