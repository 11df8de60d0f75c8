"""The relay program, as a multi-agent framework would write it: two agents, each asking for its own model
by name (`caller`, `answerer`), run unchanged through proxy_agent (the `callable` runner). The caller's
conversation and the answerer's are separate: the answerer is handed only the lookup's result, and must say
it exactly."""

from __future__ import annotations

import json
from typing import Any

import httpx
from openai import AsyncOpenAI

CALLER = "You read a request and reply with the name of the city it is about. Reply with the city name only."


def request_text(task: dict[str, Any]) -> str:
    items = task["responses_create_params"]["input"]
    return items if isinstance(items, str) else [i for i in items if i.get("role") == "user"][-1]["content"]


async def run(task: dict[str, Any], endpoint: Any) -> str:
    params = task.get("responses_create_params") or {}
    sampling = {"temperature": params.get("temperature", 0.7), "max_tokens": params.get("max_output_tokens", 12)}
    async with httpx.AsyncClient(timeout=300) as http:
        client = AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0, http_client=http)
        called = await client.chat.completions.create(
            model="caller", messages=[{"role": "system", "content": CALLER},
                                      {"role": "user", "content": request_text(task)}], **sampling)
        city = (called.choices[0].message.content or "").strip().splitlines()[0:1]
        reply = await http.post(f"{endpoint.tools_url}/lookup", content=json.dumps({"city": (city or [""])[0][:80]}),
                                headers={"Authorization": f"Bearer {endpoint.api_key}",
                                         "Content-Type": "application/json"})
        result = reply.text
        answered = await client.chat.completions.create(
            model="answerer", messages=[{"role": "user", "content": f"Say {result}."}], **sampling)
        return answered.choices[0].message.content or ""
