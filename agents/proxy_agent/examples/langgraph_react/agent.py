"""A LangGraph ReAct weather agent on `langchain-openai`, as written against OpenAI; under the proxy
only OPENAI_BASE_URL / OPENAI_API_KEY (read by the OpenAI client) differ.

    echo '{"question": "What is the weather in Paris?"}' | python agent.py

Reads a task as JSON on stdin (a rollgym weather row, or {"question": ...}); prints the answer.
"""

from __future__ import annotations

import json
import os
import sys

import httpx
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.prebuilt import create_react_agent

LOCAL = {"paris": "Paris: sunny, 22 C", "london": "London: rainy, 14 C"}


@tool
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


def main() -> None:
    model = ChatOpenAI(model=os.environ.get("OPENAI_MODEL", "gpt-4o-mini"), max_tokens=96, temperature=0.2)
    agent = create_react_agent(model, [get_weather], prompt="You are a weather assistant. Use get_weather, "
                                                            "then answer with the condition and the temperature.")
    state = agent.invoke({"messages": [("user", question(json.load(sys.stdin)))]}, {"recursion_limit": 8})
    print(state["messages"][-1].content)


if __name__ == "__main__":
    main()
