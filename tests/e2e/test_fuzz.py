"""Fuzzing every server role over real HTTP: no input may get a 5xx or hang a server.

Servers under test (each served in-process on a loopback port by rollgym.testing.serve_in_thread):
weather, inventory, reverse_text, math (resources servers), simple_agent (in front of weather) and the
chat_completions model server in front of scripts/scripted_backend.py.

1. schemathesis against each server's own /openapi.json (as served). rollgym routes read the raw JSON
   body, so those schemas have no request bodies and schemathesis can only send empty ones;
2. schemathesis against the same schema with the request bodies filled in from the pydantic models
   the routes validate with (task rows, verify bodies, tool arguments, Responses params): far more
   useful, and what exposing body schemas in the served OpenAPI would give for free;
3. a hand-written fuzz of every role's POST routes: malformed JSON, bodies over max_body_bytes (413),
   wrong types, missing fields, unknown tools, deep nesting, non-UTF-8, huge numbers, NaN, plus
   random mutations with hypothesis. Each malformed input must get a 4xx JSON error naming the problem.

Budgets: ROLLGYM_FUZZ_EXAMPLES (examples per operation and mode, default 30) and
ROLLGYM_FUZZ_SERVER_BUDGET_S (seconds of schemathesis per server, default 12, shared out over its
operations: generation from the large Responses schemas is slow on a loaded machine, so an
operation may stop before its example count; the test prints how many ran).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import time
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import aiohttp
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rollgym import ServerAddress
from rollgym.agent import AgentServer
from rollgym.model import ModelServer
from rollgym.resources import ResourcesServer
from rollgym.schema import ResponsesCreateParams
from rollgym.server import BaseServer
from rollgym.sessions import SESSION_COOKIE
from rollgym.testing import scripted_backend, serve_in_thread

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

LIMIT = 256 * 1024  # max_body_bytes of every server here, so oversized bodies are cheap to send
EXAMPLES = int(os.environ.get("ROLLGYM_FUZZ_EXAMPLES", "30"))
SERVER_BUDGET_S = float(os.environ.get("ROLLGYM_FUZZ_SERVER_BUDGET_S", "10"))
MIN_EXAMPLES = 4
TIMEOUT_S = 30.0  # a request not answered by then is a hang

TOOL = {"type": "function", "name": "get_weather", "description": "Get the weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
RESPONSE = {"id": "resp_1", "object": "response", "created_at": 0, "model": "m", "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [],
            "output": [{"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": "Paris: sunny, 22 C. \\boxed{42}", "annotations": []}]}]}
WEATHER_ROW = {"responses_create_params": {"input": "What is the weather in Paris?", "tools": [TOOL]},
               "city": "Paris", "expected": ["sunny"]}
INVENTORY_ROW = {"responses_create_params": {"input": "stock"}, "initial": {"warehouse": {"apple": 50}, "store": {}},
                 "target": {"store": {"apple": 3}}}
REVERSE_ROW = {"responses_create_params": {"input": "Reverse this text: abc"}, "text": "abc"}
MATH_ROW = {"responses_create_params": {"input": "6*7?"}, "expected_answer": "42"}
CHAT_SCHEMA = {  # what the model server's /v1/chat/completions reads itself (the rest goes to the backend)
    "type": "object", "required": ["messages"],
    "properties": {
        "messages": {"type": "array", "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["system", "user", "assistant", "tool"]}, "content": {"type": "string"}}}},
        "max_tokens": {"type": "integer", "minimum": 1}, "temperature": {"type": "number", "minimum": 0, "maximum": 2},
        "stream": {"type": "boolean"},
    },
}


@contextmanager
def quiet_server_logs() -> Iterator[None]:
    """Silence the traces that in-thread servers log for a 500 (rollgym's own and uvicorn's).

    Besides the noise: Python 3.11 formats a logged traceback with ast.parse (caret anchors), and the
    ast module's recursion counter is shared by all threads, so a server thread logging while pytest
    formats a failure in the main thread can end in "SystemError: AST constructor recursion depth
    mismatch" and an INTERNALERROR that hides the failure.
    """
    # logging.disable, not logger levels: uvicorn.Config resets the levels of its loggers.
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


@dataclass
class Target:
    """One server under test: its URL, its POST routes with a valid body each, and its session cookie."""

    name: str
    url: str
    server: BaseServer
    valid: dict[str, dict[str, Any]]  # POST path -> a valid body
    required: dict[str, list[str]] = field(default_factory=dict)  # POST path -> required top-level keys
    cookie: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Cookie": f"{SESSION_COOKIE}={self.cookie}"} if self.cookie else {}


def _config(cls: type[BaseServer], **options: Any) -> Any:
    return cls.config_class.model_validate({"max_body_bytes": LIMIT, **options})


@pytest.fixture(scope="module")
def targets() -> Iterator[dict[str, Target]]:
    from agents.simple_agent.app import SimpleAgent
    from models.chat_completions.app import ChatCompletionsModel
    from resources_servers.inventory.app import InventoryServer
    from resources_servers.math.app import MathServer
    from resources_servers.reverse_text.app import ReverseTextServer
    from resources_servers.weather.app import WeatherServer

    with quiet_server_logs(), ExitStack() as stack:
        backend = stack.enter_context(scripted_backend())
        servers: dict[str, BaseServer] = {
            "weather": WeatherServer(_config(WeatherServer), name="weather"),
            "inventory": InventoryServer(_config(InventoryServer), name="inventory"),
            "reverse_text": ReverseTextServer(_config(ReverseTextServer), name="reverse_text"),
            "math": MathServer(_config(MathServer), name="math"),
            "policy_model": ChatCompletionsModel(
                _config(ChatCompletionsModel, base_url=backend, model="scripted", timeout_s=20), name="policy_model"),
        }
        urls = {name: stack.enter_context(serve_in_thread(server)) for name, server in servers.items()}
        agent = SimpleAgent(
            _config(SimpleAgent, model_server={"name": "policy_model"}, resources_server={"name": "weather"},
                    max_steps=4, model_timeout_s=20, tool_timeout_s=20),
            name="weather_agent",
            registry={"policy_model": ServerAddress(urls["policy_model"], "models"),
                      "weather": ServerAddress(urls["weather"], "resources_servers")},
        )
        servers["weather_agent"] = agent
        urls["weather_agent"] = stack.enter_context(serve_in_thread(agent))

        verify = lambda row: {**row, "response": RESPONSE}  # noqa: E731
        result = {
            "weather": Target("weather", urls["weather"], servers["weather"], {
                "/seed_session": WEATHER_ROW, "/verify": verify(WEATHER_ROW), "/get_weather": {"city": "Paris"}},
                {"/seed_session": ["responses_create_params", "city", "expected"],
                 "/verify": ["responses_create_params", "city", "expected", "response"], "/get_weather": ["city"]}),
            "inventory": Target("inventory", urls["inventory"], servers["inventory"], {
                "/seed_session": INVENTORY_ROW, "/verify": verify(INVENTORY_ROW),
                "/list_inventory": {"location": "store"},
                "/add_item": {"location": "store", "item": "apple", "quantity": 1},
                "/remove_item": {"location": "warehouse", "item": "apple", "quantity": 1},
                "/transfer": {"item": "apple", "quantity": 1, "from_location": "warehouse", "to_location": "store"},
                "/place_order": {"item": "pear", "quantity": 2, "location": "store"}},
                {"/seed_session": ["responses_create_params", "initial", "target"],
                 "/verify": ["responses_create_params", "initial", "target", "response"],
                 "/add_item": ["location", "item", "quantity"], "/remove_item": ["location", "item", "quantity"],
                 "/transfer": ["item", "quantity", "from_location", "to_location"],
                 "/place_order": ["item", "quantity", "location"]}),
            "reverse_text": Target("reverse_text", urls["reverse_text"], servers["reverse_text"], {
                "/seed_session": REVERSE_ROW, "/verify": verify(REVERSE_ROW)},
                {"/seed_session": ["responses_create_params", "text"],
                 "/verify": ["responses_create_params", "text", "response"]}),
            "math": Target("math", urls["math"], servers["math"], {
                "/seed_session": MATH_ROW, "/verify": verify(MATH_ROW)},
                {"/seed_session": ["responses_create_params", "expected_answer"],
                 "/verify": ["responses_create_params", "expected_answer", "response"]}),
            "weather_agent": Target("weather_agent", urls["weather_agent"], agent, {
                "/run": WEATHER_ROW, "/v1/responses": WEATHER_ROW["responses_create_params"]},
                {"/run": ["responses_create_params", "city", "expected"], "/v1/responses": ["input"]}),
            "policy_model": Target("policy_model", urls["policy_model"], servers["policy_model"], {
                "/v1/responses": {"input": "hi", "max_output_tokens": 16},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]}},
                {"/v1/responses": ["input"], "/v1/chat/completions": ["messages"]}),
        }
        # Inventory tools and /verify need a seeded session (unseeded is a documented 500: an env failure).
        result["inventory"].cookie = asyncio.run(_seed(urls["inventory"], INVENTORY_ROW))
        yield result


async def _seed(url: str, row: dict[str, Any]) -> str:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        async with http.post(url + "/seed_session", json=row) as reply:
            assert reply.status == 200
            return reply.cookies[SESSION_COOKIE].value


ROUTES = [(name, path) for name, paths in {
    "weather": ["/seed_session", "/verify", "/get_weather"],
    "inventory": ["/seed_session", "/verify", "/list_inventory", "/add_item", "/remove_item", "/transfer", "/place_order"],
    "reverse_text": ["/seed_session", "/verify"],
    "math": ["/seed_session", "/verify"],
    "weather_agent": ["/run", "/v1/responses"],
    "policy_model": ["/v1/responses", "/v1/chat/completions"],
}.items() for path in paths]
SERVERS = ["weather", "inventory", "reverse_text", "math", "weather_agent", "policy_model"]


# --- HTTP helpers ---------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    body: bytes
    headers: Any

    def error(self) -> dict[str, Any]:
        payload = orjson.loads(self.body)
        assert isinstance(payload, dict) and isinstance(payload.get("error"), dict), self.body[:300]
        assert payload["error"].get("message"), payload
        return payload["error"]


def send_many(target: Target, requests: list[tuple[str, str, Any, dict[str, str]]], concurrency: int = 8) -> list[Answer]:
    """Send (method, path, body bytes | async generator factory | None, headers); a hang fails the test."""

    async def main() -> list[Answer]:
        semaphore = asyncio.Semaphore(concurrency)
        # A fresh connection per request: a 500 closes its connection (tests/test_faults.py), which must not
        # turn into a confusing reset of the next request here.
        connector = aiohttp.TCPConnector(force_close=True)
        timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
        async with aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar(), timeout=timeout,
                                         auto_decompress=False) as http:

            async def one(method: str, path: str, body: Any, headers: dict[str, str]) -> Answer:
                async with semaphore:
                    data = body() if callable(body) else body
                    try:
                        async with http.request(method, target.url + path, data=data,
                                                headers={**target.headers(), **headers}) as reply:
                            return Answer(reply.status, await reply.read(), reply.headers)
                    except asyncio.TimeoutError:
                        raise AssertionError(f"{target.name} {method} {path}: no answer in {TIMEOUT_S} s (a hang)") from None

            return await asyncio.gather(*(one(*request) for request in requests))

    return asyncio.run(main())


def post_all(target: Target, path: str, bodies: list[Any], headers: dict[str, str] | None = None) -> list[Answer]:
    return send_many(target, [("POST", path, body, {"Content-Type": "application/json", **(headers or {})}) for body in bodies])


# --- 1. schemathesis against the served schemas ---------------------------------------------------------------


def _run_operation(op: Any, mode: GenerationMode, base_url: str, cookies: dict[str, str], max_examples: int,
                   budget_s: float) -> tuple[int, list[str]]:
    """Run one operation in one generation mode; returns (examples sent, failures)."""
    sent = 0
    failures: list[str] = []
    deadline = time.monotonic() + budget_s
    minimum = MIN_EXAMPLES if mode is GenerationMode.POSITIVE else 1  # even over budget

    class OutOfBudget(Exception):
        pass

    try:
        strategy = op.as_strategy(generation_mode=mode)
    except Exception as exc:  # noqa: BLE001 - schemathesis cannot build this mode for this operation
        return 0, [] if mode is GenerationMode.NEGATIVE else [f"{op.label}: no strategy: {exc}"]

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(case=strategy)
    def check(case: Any) -> None:
        nonlocal sent
        if time.monotonic() > deadline and sent >= minimum:
            raise OutOfBudget
        response = case.call(base_url=base_url, cookies=cookies, timeout=TIMEOUT_S)
        sent += 1
        case.validate_response(response, checks=[not_a_server_error])

    try:
        check()
    except OutOfBudget:
        pass
    except Exception as exc:  # noqa: BLE001 - a failed check, reported with the operation
        if type(exc).__name__ == "Unsatisfiable":  # no negative case exists for an operation without parameters
            return sent, []
        failures.append(f"{op.label} [{mode.value}]: {type(exc).__name__}: {str(exc)[:3000]}")
    return sent, failures


def _run_schema(schema: Any, target: Target, max_examples: int, budget_s: float) -> tuple[dict[str, int], list[str]]:
    """Every operation, positive cases first, then negative; the budget is shared out as it goes."""
    cookies = {SESSION_COOKIE: target.cookie} if target.cookie else {}
    counts: dict[str, int] = {}
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    runs = [(op, mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) for op in operations]
    deadline = time.monotonic() + budget_s
    for index, (op, mode) in enumerate(runs):
        share = max(0.5, (deadline - time.monotonic()) / (len(runs) - index))
        sent, failed = _run_operation(op, mode, target.url, cookies, max_examples, share)
        counts[f"{op.label} [{mode.value}]"] = sent
        failures.extend(failed)
    return counts, failures


@pytest.mark.parametrize("name", SERVERS)
def test_schemathesis_served_schema_no_server_error(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    schema = schemathesis.openapi.from_url(target.url + "/openapi.json")
    counts, failures = _run_schema(schema, target, EXAMPLES, SERVER_BUDGET_S / 2)
    assert counts and sum(counts.values()) > 0
    if failures:  # pytrace=False: schemathesis' report says it all
        pytest.fail("\n".join(failures), pytrace=False)


def body_schemas(server: BaseServer) -> dict[str, Any]:
    """POST path -> (pydantic model or JSON schema) of the body the route validates."""
    from resources_servers.weather.app import WeatherTask

    if isinstance(server, ResourcesServer):
        bodies: dict[str, Any] = {"/seed_session": server.task_model, "/verify": server.verify_model}
        bodies.update({f"/{name}": spec.args_model for name, spec in server.tools.items()})
        return bodies
    if isinstance(server, AgentServer):
        return {"/run": WeatherTask, "/v1/responses": ResponsesCreateParams}  # this agent runs weather tasks
    if isinstance(server, ModelServer):
        return {"/v1/responses": ResponsesCreateParams, "/v1/chat/completions": CHAT_SCHEMA}
    return {}


def schema_with_bodies(server: BaseServer, app_schema: dict[str, Any]) -> dict[str, Any]:
    """The server's OpenAPI document with each POST route's request body filled in from its model."""
    components = app_schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in body_schemas(server).items():
        if isinstance(model, dict):
            body = model
        else:
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for key, value in body.pop("$defs", {}).items():
                components.setdefault(key, value)
        app_schema["paths"][path]["post"]["requestBody"] = {
            "required": True, "content": {"application/json": {"schema": body}}}
    return app_schema


@pytest.mark.parametrize("name", SERVERS)
def test_schemathesis_with_body_schemas_no_server_error(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    document = schema_with_bodies(target.server, target.server.build_app().openapi())
    schema = schemathesis.openapi.from_dict(document)
    counts, failures = _run_schema(schema, target, EXAMPLES, SERVER_BUDGET_S)
    print(name, counts)
    if failures:  # pytrace=False: schemathesis' report says it all
        pytest.fail("\n".join(failures), pytrace=False)
    filled = {f"POST {path} [positive]" for path in body_schemas(target.server)}
    assert all(counts.get(label, 0) >= MIN_EXAMPLES for label in filled), counts


# --- 3. hand-written fuzz: malformed bodies -------------------------------------------------------------------

# (label, body, what the error message must mention)
MALFORMED: list[tuple[str, bytes, tuple[str, ...]]] = [
    ("empty", b"", ("empty",)),
    ("whitespace", b" \n\t ", ("JSON",)),
    ("truncated", b'{"responses_create_params": {"input": ', ("JSON",)),
    ("garbage", b"{oops", ("JSON",)),
    ("trailing junk", b'{"a": 1} x', ("JSON",)),
    ("single quotes", b"{'a': 1}", ("JSON",)),
    ("trailing comma", b'{"a": 1,}', ("JSON",)),
    ("comment", b'{"a": 1 /* c */}', ("JSON",)),
    ("non-UTF-8 bytes", b"\xff\xfe\x00{\x00}", ("UTF-8",)),
    ("non-UTF-8 in a string", b'{"city": "\xc3\x28"}', ("UTF-8",)),
    ("latin-1 body", '{"city": "Zürich"}'.encode("latin-1"), ("UTF-8",)),
    ("lone surrogate", b'{"city": "\\ud800"}', ("surrogate",)),
    ("NaN", b'{"temperature": NaN}', ("JSON",)),
    ("Infinity", b'{"temperature": Infinity}', ("JSON",)),
    ("-Infinity", b'{"temperature": -Infinity}', ("JSON",)),
    ("1e400", b'{"temperature": 1e400}', ("infinity",)),
    ("deep arrays", b"[" * 100_000 + b"]" * 100_000, ("depth",)),
    ("deep objects", b'{"a":' * 5000 + b"1" + b"}" * 5000, ("depth",)),
    ("unclosed deep", b"[" * 3000, ("JSON",)),
    ("null", b"null", ()),
    ("array", b"[]", ()),
    ("number", b"5", ()),
    ("huge number", b"1" * 5000, ()),
    ("string", b'"hello"', ()),
    ("boolean", b"true", ()),
    ("array of objects", b'[{"responses_create_params": {"input": "x"}}]', ()),
]


def post_routes(target: Target) -> list[str]:
    """Every POST route the live server documents (new routes get fuzzed without editing this file)."""
    (answer,) = send_many(target, [("GET", "/openapi.json", None, {})])
    assert answer.status == 200
    paths = orjson.loads(answer.body)["paths"]
    routes = sorted(path for path, operations in paths.items() if "post" in operations)
    assert set(target.valid) <= set(routes), (set(target.valid) - set(routes))
    return routes


@pytest.mark.parametrize("name", SERVERS)
def test_malformed_bodies_get_a_4xx_json_error(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    problems = []
    for path in post_routes(target):
        answers = post_all(target, path, [body for _, body, _ in MALFORMED])
        for (label, _, mentions), answer in zip(MALFORMED, answers):
            if not 400 <= answer.status < 500:
                problems.append(f"{path} {label}: HTTP {answer.status} {answer.body[:200]!r}")
                continue
            error = answer.error()
            if not all(m.lower() in error["message"].lower() for m in mentions):
                problems.append(f"{path} {label}: message does not name the problem: {error['message']!r}")
            if answer.status in (400, 422) and not error.get("field"):
                problems.append(f"{path} {label}: no field in {error}")
    assert not problems, "\n".join(problems)


def _missing_and_wrong_types(target: Target, path: str) -> list[tuple[str, dict[str, Any], str]]:
    """(label, body, the field the error must name): each required key missing, then given a wrong type."""
    valid = target.valid[path]
    cases = []
    for key in target.required.get(path, []):
        cases.append((f"missing {key}", {k: v for k, v in valid.items() if k != key}, key))
        wrong = {"responses_create_params": 5, "input": 5, "messages": "hi", "city": 123, "expected": "sunny",
                 "initial": [1], "target": "x", "text": ["abc"], "expected_answer": None, "response": "done",
                 "location": ["store"], "item": {"a": 1}, "quantity": "many", "from_location": 1.5,
                 "to_location": False}.get(key, 5)
        cases.append((f"{key} of the wrong type", {**valid, key: wrong}, key))
    return cases


@pytest.mark.parametrize("name,path", ROUTES, ids=[f"{n}{p}" for n, p in ROUTES])
def test_wrong_types_and_missing_fields_name_the_field(targets: dict[str, Target], name: str, path: str) -> None:
    target = targets[name]
    cases = _missing_and_wrong_types(target, path)
    if not cases:
        pytest.skip("no required field")
    answers = post_all(target, path, [orjson.dumps(body) for _, body, _ in cases])
    problems = []
    for (label, _, key), answer in zip(cases, answers):
        if not 400 <= answer.status < 500:
            problems.append(f"{label}: HTTP {answer.status} {answer.body[:200]!r}")
            continue
        error = answer.error()
        if not (error.get("field") == key or str(error.get("field", "")).startswith((key + ".", key + "["))):
            problems.append(f"{label}: field {error.get('field')!r}, message {error['message']!r}")
    assert not problems, "\n".join(problems)


# Route-specific values that must be refused, with the field named.
BAD_VALUES: dict[tuple[str, str], list[tuple[str, dict[str, Any], str]]] = {
    ("weather", "/get_weather"): [("empty city", {"city": ""}, "city"), ("unknown arg", {"city": "Oslo", "x": 1}, "x")],
    ("inventory", "/add_item"): [
        ("huge quantity", {"location": "store", "item": "apple", "quantity": 10**30}, "quantity"),
        ("u64 quantity", {"location": "store", "item": "apple", "quantity": 2**64 - 1}, "quantity"),
        ("negative quantity", {"location": "store", "item": "apple", "quantity": -(2**63)}, "quantity"),
        ("float quantity", {"location": "store", "item": "apple", "quantity": 1.5}, "quantity"),
        ("bool quantity", {"location": "store", "item": "apple", "quantity": True}, "quantity"),
        ("long name", {"location": "store", "item": "a" * 65, "quantity": 1}, "item"),
    ],
    ("inventory", "/seed_session"): [
        ("negative stock", {**INVENTORY_ROW, "initial": {"store": {"apple": -1}}}, "initial.store.apple"),
        ("huge stock", {**INVENTORY_ROW, "initial": {"store": {"apple": 10**20}}}, "initial.store.apple"),
        ("nan price", {**INVENTORY_ROW, "prices": {"apple": -1.0}}, "prices.apple"),
    ],
    ("policy_model", "/v1/responses"): [
        ("huge max_output_tokens", {"input": "hi", "max_output_tokens": 10**30}, "max_output_tokens"),
        ("zero max_output_tokens", {"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ("temperature 1e308", {"input": "hi", "temperature": 1e308}, "temperature"),
        ("string temperature", {"input": "hi", "temperature": "hot"}, "temperature"),
        ("tool_choice names no tool", {"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ("unknown item type", {"input": [{"type": "banana"}]}, "input[0]"),
        ("orphan tool output", {"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input[0].call_id"),
        ("metadata not strings", {"input": "hi", "metadata": {"a": 5}}, "metadata.a"),
    ],
    ("policy_model", "/v1/chat/completions"): [
        ("stream not a boolean", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        ("messages not a list", {"messages": {"role": "user"}}, "messages"),
    ],
    ("weather_agent", "/run"): [
        ("rollout_id not a string", {**WEATHER_ROW, "rollout_id": 5}, "rollout_id"),
        ("expected empty", {**WEATHER_ROW, "expected": []}, "expected"),
        ("input item not an object", {**WEATHER_ROW, "responses_create_params": {"input": [5]}}, "responses_create_params.input[0]"),
    ],
}


@pytest.mark.parametrize("key", list(BAD_VALUES), ids=[f"{n}{p}" for n, p in BAD_VALUES])
def test_bad_values_are_refused_naming_the_field(targets: dict[str, Target], key: tuple[str, str]) -> None:
    target = targets[key[0]]
    cases = BAD_VALUES[key]
    # The stdlib encoder: it writes integers beyond 64 bits, which orjson refuses to.
    answers = post_all(target, key[1], [json.dumps(body).encode() for _, body, _ in cases])
    problems = []
    for (label, _, field_name), answer in zip(cases, answers):
        if not 400 <= answer.status < 500:
            problems.append(f"{label}: HTTP {answer.status} {answer.body[:200]!r}")
        elif answer.error().get("field") != field_name:
            problems.append(f"{label}: field {answer.error().get('field')!r} != {field_name!r}: {answer.error()['message']}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name,path", ROUTES, ids=[f"{n}{p}" for n, p in ROUTES])
def test_oversized_bodies_get_413(targets: dict[str, Target], name: str, path: str) -> None:
    target = targets[name]
    base = orjson.dumps(target.valid[path])
    padding = LIMIT + 1 - len(base) - len(b',"pad":""')
    big = base[:-1] + b',"pad":"' + b"x" * padding + b'"}'
    assert len(big) == LIMIT + 1

    def chunked() -> Any:  # no Content-Length: the limit must hold while streaming too
        async def gen() -> Any:
            for start in range(0, len(big), 16384):
                yield big[start:start + 16384]
        return gen()

    huge_length = {"Content-Length": str(10**12)}  # announced, never sent: refused before reading
    answers = send_many(target, [("POST", path, big, {"Content-Type": "application/json"}),
                                 ("POST", path, chunked, {"Content-Type": "application/json"})])
    for answer in answers:
        assert answer.status == 413, (answer.status, answer.body[:200])
        error = answer.error()
        assert error["type"] == "payload_too_large" and str(LIMIT) in error["message"]
    # Under the limit is read normally (whatever the route then says of the padding). The margin leaves
    # room for what an agent adds when it forwards the body to a server with the same limit.
    small = base[:-1] + b',"pad":"' + b"x" * (padding - 4096) + b'"}'
    (answer,) = post_all(target, path, [small])
    assert answer.status < 500, (answer.status, answer.body[:200])
    if answer.status == 413:  # only an agent, relaying the 413 of the server it forwarded the body to
        assert isinstance(target.server, AgentServer) and "rejected the task" in answer.error()["message"]
    # An announced Content-Length over the limit is refused from the headers alone.
    with socket.create_connection(("127.0.0.1", int(target.url.rsplit(":", 1)[1])), timeout=TIMEOUT_S) as conn:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in {**huge_length, **target.headers()}.items()) + "\r\n"
        conn.sendall(head.encode())
        reply = conn.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


@pytest.mark.parametrize("name", ["weather", "inventory", "reverse_text", "math"])
def test_unknown_tools_and_wrong_methods_get_json_errors(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    requests = [
        ("POST", "/no_such_tool", b'{"city": "Paris"}', {}),
        ("POST", "/get_weather_" + "x" * 300, b"{}", {}),
        ("POST", "/../seed_session", b"{}", {}),
        ("POST", "/%00", b"{}", {}),
        ("POST", "/tools", b"{}", {}),     # GET-only route
        ("GET", "/seed_session", None, {}),  # POST-only route
        ("DELETE", "/verify", None, {}),
        ("PUT", "/health", b"{}", {}),
    ]
    answers = send_many(target, requests)
    for (method, path, _, _), answer in zip(requests, answers):
        assert 400 <= answer.status < 500, (method, path, answer.status, answer.body[:200])
        error = answer.error()
        if answer.status == 404:
            assert error["type"] == "not_found" and "no route" in error["message"], error
        if answer.status == 405:
            assert error["type"] == "method_not_allowed", error


# --- deep nesting that the JSON parser accepts but the encoder does not -------------------------------------

DEEP = 300  # orjson reads 1024 levels but writes only 254: a body between the two is accepted, then echoed


def _deep_body(target: Target, path: str, key: str = "deep") -> bytes:
    base = orjson.dumps(target.valid[path])
    return base[:-1] + f',"{key}":'.encode() + b"[" * DEEP + b"]" * DEEP + b"}"


# orjson reads 1024 levels but writes 254: a body between the two must still get a 4xx, never a 500.
DEEP_ROUTES = [pytest.param(n, p, id=f"{n}{p}") for n, p in ROUTES]


@pytest.mark.parametrize("name,path", DEEP_ROUTES)
def test_deep_nesting_within_the_parser_limit_is_not_a_server_error(targets: dict[str, Target], name: str, path: str) -> None:
    target = targets[name]
    key = "deep" if path not in ("/get_weather", "/list_inventory", "/add_item", "/remove_item", "/transfer",
                                 "/place_order") else "quantity"
    (answer,) = post_all(target, path, [_deep_body(target, path, key)])
    assert answer.status < 500, (answer.status, answer.body[:200])
    if answer.status >= 400:
        answer.error()


# --- hypothesis: random documents and random mutations ---------------------------------------------------------

JSON_LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
               | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30))
JSON_VALUES = st.recursive(JSON_LEAVES, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4), max_leaves=15)
JUNK = [b"\x00", b"\xff", b",", b"]", b"{", b'"', b"\\", b"NaN", b"1e999", b"-0", b"99999999999999999999999",
        b'"\\ud800"', b"\xe2\x80", b"[" * 300, b"}" * 3, b"\n"]


@st.composite
def mutated_body(draw: Any, valid: dict[str, Any]) -> bytes:
    """A valid body with one random change: a key given a random JSON value, bytes flipped, cut short,
    junk inserted, or a random JSON document instead."""
    base = orjson.dumps(valid)
    kind = draw(st.sampled_from(["replace", "flip", "cut", "insert", "document"]))
    if kind == "replace":
        body = dict(valid)
        key = draw(st.sampled_from([*valid, "responses_create_params.input", "extra"]))
        value = draw(JSON_VALUES)
        if key == "responses_create_params.input" and isinstance(body.get("responses_create_params"), dict):
            body["responses_create_params"] = {**body["responses_create_params"], "input": value}
        else:
            body[key] = value
        return orjson.dumps(body)
    if kind == "flip":
        raw = bytearray(base)
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw)
    if kind == "cut":
        return base[: draw(st.integers(0, len(base) - 1))]
    if kind == "insert":
        position = draw(st.integers(0, len(base)))
        return base[:position] + draw(st.sampled_from(JUNK)) + base[position:]
    return orjson.dumps(draw(JSON_VALUES))


@pytest.mark.parametrize("name", SERVERS)
def test_random_mutations_never_get_a_server_error(targets: dict[str, Target], name: str) -> None:
    target = targets[name]
    problems: list[str] = []
    total = 0
    for path in post_routes(target):
        bodies: list[bytes] = []

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(body=mutated_body(target.valid.get(path, {"text": "hello", "tokens": [1, 2, 3]})))
        def collect(body: bytes) -> None:
            bodies.append(body)

        collect()
        total += len(bodies)
        answers = post_all(target, path, bodies)
        for body, answer in zip(bodies, answers):
            if answer.status >= 500:
                problems.append(f"{path}: HTTP {answer.status} for {body[:300]!r}: {answer.body[:300]!r}")
            elif answer.status >= 400:
                answer.error()
    assert not problems, f"{len(problems)} of {total}:\n" + "\n".join(problems[:8])


# --- a slow grader must not stall the server --------------------------------------------------------------------


def test_reverse_text_verify_of_a_long_answer_does_not_stall_the_server() -> None:
    from resources_servers.reverse_text.app import ReverseTextServer

    text = "abcdefghij" * 1_000  # the longest text a task may have
    row = {"responses_create_params": {"input": "Reverse this text: ..."}, "text": text}
    answer_response = {**RESPONSE, "output": [{**RESPONSE["output"][0], "content": [
        {"type": "output_text", "text": "jihgfedcbaz" * 18_000, "annotations": []}]}]}

    async def main(url: str) -> float:
        async with aiohttp.ClientSession() as http:
            async def verify() -> None:
                async with http.post(url + "/verify", json={**row, "response": answer_response},
                                     timeout=aiohttp.ClientTimeout(total=120)) as reply:
                    await reply.read()
            grading = asyncio.create_task(verify())
            await asyncio.sleep(0.3)
            started = time.monotonic()
            try:
                async with http.get(url + "/health", timeout=aiohttp.ClientTimeout(total=3)) as reply:
                    assert reply.status == 200
            finally:
                waited = time.monotonic() - started
                await grading
            return waited

    with quiet_server_logs(), serve_in_thread(ReverseTextServer(name="reverse_text")) as url:
        waited = asyncio.run(main(url))
    assert waited < 1.0, f"/health waited {waited:.1f} s behind one /verify"


# --- a bad request the model server refuses is the caller's fault, not an infrastructure failure -----------

ORPHAN_OUTPUT = [{"role": "user", "content": "What is the weather in Paris?"},
                 {"type": "function_call_output", "call_id": "call_nope", "output": "sunny"}]


def test_agent_responses_with_a_bad_input_item_is_a_4xx(targets: dict[str, Target]) -> None:
    (answer,) = post_all(targets["weather_agent"], "/v1/responses", [orjson.dumps({"input": ORPHAN_OUTPUT})])
    assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
    assert answer.error().get("field") == "input[1].call_id"


def test_agent_run_with_a_task_the_model_refuses_is_rejected_not_a_model_error(targets: dict[str, Target]) -> None:
    row = {**WEATHER_ROW, "responses_create_params": {**WEATHER_ROW["responses_create_params"], "input": ORPHAN_OUTPUT}}
    (answer,) = post_all(targets["weather_agent"], "/run", [orjson.dumps(row)])
    assert 400 <= answer.status < 500, (answer.status, answer.body[:300])


def test_scripted_backend_refuses_non_object_messages() -> None:
    async def main(url: str) -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/chat/completions", json={"messages": [5]}) as reply:
                return reply.status, await reply.read()

    with scripted_backend() as url:
        status, body = asyncio.run(main(url))
    assert status == 400, (status, body[:200])
