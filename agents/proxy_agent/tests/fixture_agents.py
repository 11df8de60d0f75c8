"""Small external agents for the proxy's tests, each written as its authors would against OpenAI:
the `openai` SDK, its own tool loop, and only the base URL and key from the proxy."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from openai import AsyncOpenAI

from agents.proxy_agent.runners import Endpoint

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# Endpoints seen by `remember`, for the tests that replay a rollout's URL.
SEEN: list[Endpoint] = []
# One HTTP client per event loop: building one loads the CA bundle (~0.1 s of CPU), which 64
# rollouts in one loop would otherwise pay 64 times.
# Keyed by the loop itself (kept alive here), so a later loop can never reuse a closed one's client.
_HTTP: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def shared_http() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        _HTTP[loop] = httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=None))
    return _HTTP[loop]


def openai_client(endpoint: Endpoint) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0, http_client=shared_http())


def question(task: dict[str, Any]) -> str:
    """The user's question of a weather task row."""
    items = task["responses_create_params"]["input"]
    return items if isinstance(items, str) else [i for i in items if i.get("role") == "user"][-1]["content"]


async def call_tool(endpoint: Endpoint, name: str, arguments: str) -> str:
    reply = await shared_http().post(f"{endpoint.tools_url}/{name}", content=arguments,
                                     headers={"Authorization": f"Bearer {endpoint.api_key}",
                                              "Content-Type": "application/json"})
    return reply.text


async def weather_loop(task: dict[str, Any], endpoint: Endpoint, *, stream: bool = False,
                       tools: list[dict[str, Any]] | None = None, run_tool: Any = None) -> str:
    """A chat-completions tool loop: ask, run the tool calls, ask again until the model answers."""
    client = openai_client(endpoint)
    tools = tools or [WEATHER_TOOL]
    run_tool = run_tool or (lambda name, arguments: call_tool(endpoint, name, arguments))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather assistant."},
                                      {"role": "user", "content": question(task)}]
    for _ in range(4):
        if stream:
            async with client.chat.completions.stream(model=endpoint.model, messages=messages,
                                                      tools=tools, max_tokens=64) as events:
                completion = await events.get_final_completion()
        else:
            completion = await client.chat.completions.create(model=endpoint.model, messages=messages,
                                                              tools=tools, max_tokens=64)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"}))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            output = await run_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return ""


async def mcp_tools_loop(task: dict[str, Any], endpoint: Endpoint) -> str:
    """The loop with the environment's tools taken from the rollout's MCP endpoint."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    assert endpoint.mcp_url, "the proxy serves no MCP endpoint (serve_mcp: false)"
    SEEN.append(endpoint)
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {endpoint.api_key}"}) as http, \
            Client(streamable_http_client(endpoint.mcp_url, http_client=http)) as session:
        listed = (await session.list_tools()).tools
        tools = [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                   "parameters": tool.input_schema}} for tool in listed]

        async def run_tool(name: str, arguments: str) -> str:
            result = await session.call_tool(name, json.loads(arguments))
            return "".join(block.text for block in result.content if block.type == "text")

        return await weather_loop(task, endpoint, tools=tools, run_tool=run_tool)


async def weather_loop_streaming(task: dict[str, Any], endpoint: Endpoint) -> str:
    return await weather_loop(task, endpoint, stream=True)


async def responses_loop(task: dict[str, Any], endpoint: Endpoint) -> str:
    """The same loop on the Responses API, streamed, carrying the conversation as output items."""
    client = openai_client(endpoint)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    items: list[Any] = [{"role": "user", "content": question(task)}]
    for _ in range(4):
        async with client.responses.stream(model=endpoint.model, input=items, tools=tools,
                                           max_output_tokens=64) as events:
            response = await events.get_final_response()
        items += [item.model_dump(exclude_none=True) for item in response.output]
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        for call in calls:
            items.append({"type": "function_call_output", "call_id": call.call_id,
                          "output": await call_tool(endpoint, call.name, call.arguments)})
    return ""


async def chained_responses(task: dict[str, Any], endpoint: Endpoint) -> str:
    """The Responses loop with the conversation kept server-side (`previous_response_id`)."""
    client = openai_client(endpoint)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    response = await client.responses.create(model=endpoint.model, input=question(task), tools=tools)
    for _ in range(4):
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        outputs = [{"type": "function_call_output", "call_id": call.call_id,
                    "output": await call_tool(endpoint, call.name, call.arguments)} for call in calls]
        response = await client.responses.create(model=endpoint.model, input=outputs, tools=tools,
                                                 previous_response_id=response.id)
    return ""


async def branching(task: dict[str, Any], endpoint: Endpoint) -> str:
    """Two parallel sub-agents with their own prompts, then the main loop."""
    client = openai_client(endpoint)
    await asyncio.gather(*(client.chat.completions.create(
        model=endpoint.model, max_tokens=16,
        messages=[{"role": "user", "content": f"Sub-task {n}: say hello"}]) for n in (1, 2)))
    return await weather_loop(task, endpoint)


async def remember(task: dict[str, Any], endpoint: Endpoint) -> str:
    """Records its endpoint, then runs the weather loop."""
    SEEN.append(endpoint)
    return await weather_loop(task, endpoint)


PEERS: dict[str, Endpoint] = {}
CROSSED: set[str] = set()


async def _until(condition: Any) -> bool:
    for _ in range(500):
        if condition():
            return True
        await asyncio.sleep(0.01)
    return False


async def cross_check(task: dict[str, Any], endpoint: Endpoint) -> str:
    """Waits for another rollout to start, then calls that rollout's URL with its own key: the
    answer is the HTTP status the proxy gave."""
    PEERS[task["city"]] = endpoint
    if not await _until(lambda: len(PEERS) > 1):
        return "no peer"
    others = [e for city, e in PEERS.items() if city != task["city"]]
    reply = await shared_http().post(f"{others[0].base_url}/chat/completions", json={
        "model": "x", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {endpoint.api_key}"})
    CROSSED.add(task["city"])
    await _until(lambda: len(CROSSED) > 1)  # the peer stays running until both have tried
    await weather_loop(task, endpoint)
    return str(reply.status_code)


async def scored(task: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """A workflow that scores itself (the reward: agent setting)."""
    answer = await weather_loop(task, endpoint)
    return {"answer": answer, "score": 0.25 if task["city"].lower() in answer.lower() else 0.0}


async def token_visibility(task: dict[str, Any], endpoint: Endpoint) -> dict[str, Any]:
    """Which token fields the agent sees, on both routes, without and with asking for them."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"}
    seen = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for ask in (False, True):
            extra = {"return_token_ids": True} if ask else {}
            chat = (await http.post(f"{endpoint.base_url}/chat/completions", headers=headers, json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})).json()
            response = (await http.post(f"{endpoint.base_url}/responses", headers=headers, json={
                "model": "m", "input": "hi", **extra})).json()
            seen[f"chat_{ask}"] = "prompt_token_ids" in chat and "token_ids" in chat["choices"][0]
            seen[f"responses_{ask}"] = any("generation_token_ids" in item for item in response["output"])
    return {"answer": json.dumps(seen)}


async def crash(task: dict[str, Any], endpoint: Endpoint) -> str:
    raise RuntimeError("the agent's own bug")


def as_json(value: Any) -> str:
    return json.dumps(value)
