"""End to end with a real Phoenix server and the real embedded model (SmolLM2-135M on llama.cpp):

- an unchanged openai-SDK agent, instrumented only by OpenInference, answers weather questions; Phoenix
  records its spans; feedback scores are attached in Phoenix afterwards; `trace://phoenix/<project>` reads
  them back into re-tokenized SFT records of the well-scored answers;
- rollgym's own weather agent with `tracing.otlp_endpoint` sends one trace per rollout to Phoenix, which
  read back carries the served tokens exactly (token_source: served) and the verified reward.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the traces extra: pip install 'rollgym[traces]'")
pytest.importorskip("openinference.instrumentation.openai", reason="the traces extra: pip install 'rollgym[traces]'")
pytest.importorskip("llama_cpp", reason="the embedded model needs llama-cpp-python (make install builds it)")

from rollgym import Stack, load_stack
from rollgym.testing import REPO_ROOT
from rollgym.traces import phoenix as phx
from rollgym.traces.sources import read_source, read_traces

pytestmark = pytest.mark.slow
CITIES = ["Paris", "Tokyo", "Oslo"]


@pytest.fixture(scope="module")
def stack(phoenix: str) -> Any:
    config = load_stack([REPO_ROOT / "resources_servers/weather/configs/weather.yaml"],
                        ["policy_model.n_ctx=2048", f"weather_agent.tracing.otlp_endpoint={phoenix}",
                         "weather_agent.tracing.project=rollouts"])
    running = Stack(config)
    registry = running.start(timeout_s=180)
    try:
        yield registry
    finally:
        running.stop()


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"Phoenix did not show {what} in {timeout_s} s")
        time.sleep(0.3)


def roots(url: str, project: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/v1/projects/{project}/spans", params={"limit": 100}, timeout=10)
    return [s for s in response.json().get("data", []) if not s.get("parent_id")] if response.status_code == 200 else []


def test_an_openinference_agent_traced_in_phoenix_becomes_sft_records(phoenix: str, stack: Any, tokenizer: Any) -> None:
    import openai
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    client = openai.OpenAI(base_url=f"{stack['policy_model'].url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    provider = TracerProvider(resource=Resource.create({"openinference.project.name": "agent"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{phoenix}/v1/traces")))
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    replies = {}
    try:  # the agent: plain openai SDK code, nothing of rollgym's
        for city in CITIES:
            answer = client.chat.completions.create(model=model, max_tokens=12, temperature=0.0, messages=[
                {"role": "user", "content": f"What is the weather in {city}? One sentence."}])
            replies[city] = answer.choices[0].message.content
    finally:
        OpenAIInstrumentor().uninstrument()
        provider.shutdown()
    wait_for(lambda: len(roots(phoenix, "agent")) == len(CITIES), "the agent's traces")
    found = read_traces(f"trace://phoenix/agent?url={phoenix}")
    assert len(found) == len(CITIES) and all(t.token_source == "retokenized" for t in found)
    by_city = {next(c for c in CITIES if c in str(t.input)): t for t in found}
    for city, trace in by_city.items():
        [call] = trace.llm_steps()
        assert call.input["messages"][-1] == {"role": "user", "content": f"What is the weather in {city}? One sentence."}
        assert call.output["messages"][-1]["content"] == replies[city]
    # Feedback afterwards, in Phoenix: thumbs up for Paris and Tokyo, down for Oslo.
    for city, score in zip(CITIES, [1.0, 1.0, 0.0]):
        phx.annotate(by_city[city].episode.id, "thumbs", score, label="up" if score else "down", url=phoenix)
    records = read_source(f"trace://phoenix/agent?url={phoenix}&score=thumbs&min_reward=1", "sft", "bundled",
                          tokenizer).records
    assert sorted(r["rollout_id"] for r in records) == sorted(by_city[c].episode.id for c in CITIES[:2])
    for record in records:
        said = tokenizer.decode([t for t, m in zip(record["completion_ids"], record["completion_mask"]) if m])
        city = next(c for c in CITIES if c in record["messages"][0]["content"])
        assert record["token_source"] == "retokenized" and said.startswith(replies[city].strip()[:10])


def test_rollgym_rollouts_traced_to_phoenix_keep_their_served_tokens(phoenix: str, stack: Any) -> None:
    import json

    rows = [json.loads(line) for line in (REPO_ROOT / "resources_servers/weather/data/example.jsonl").read_text()
            .splitlines()[:2]]
    results = []
    for i, row in enumerate(rows):
        row["responses_create_params"].update(max_output_tokens=48, temperature=0.0,
                                              tool_choice={"type": "function", "name": "get_weather"})
        response = httpx.post(f"{stack['weather_agent'].url}/run", json={**row, "rollout_id": f"r{i}"}, timeout=300)
        assert response.status_code == 200, response.text
        results.append(response.json())
    wait_for(lambda: len(roots(phoenix, "rollouts")) == len(rows), "the rollouts' traces")
    found = {t.episode.id: t for t in read_traces(f"trace://phoenix/rollouts?url={phoenix}")}
    assert set(found) == {"r0", "r1"}
    from rollgym.traces.tokens import served_sequences

    for result in results:
        trace = found[result["rollout_id"]]
        assert trace.token_source == "served" and trace.reward() == result["reward"]
        sequences = served_sequences(trace)
        assert [s["completion_ids"] for s in sequences] == [s["completion_ids"] for s in result["sequences"]]
        for ours, served in zip(sequences, result["sequences"]):
            assert ours["prompt_ids"] == served["prompt_ids"] and ours["completion_mask"] == served["completion_mask"]
            assert ours["completion_logprobs"] == pytest.approx(served["completion_logprobs"])
        assert any(step.kind == "tool" and step.name == "get_weather" for step in trace.steps)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def served_prompt(stack: Any, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids the embedded model server builds for these chat messages and the weather tool."""
    from rollgym.chat_conversion import chat_messages_to_responses_input, chat_tools_to_responses_tools

    reply = httpx.post(f"{stack['policy_model'].url}/tokenize", timeout=60, json={
        "input": chat_messages_to_responses_input(messages), "tools": chat_tools_to_responses_tools([WEATHER_TOOL])})
    assert reply.status_code == 200, reply.text
    return reply.json()["tokens"]


def tool_agent(client: Any, model: str, city: str) -> list[dict[str, Any]]:
    """A forced get_weather call, its result, an answer: the conversation as the agent kept it."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer weather questions."},
                                      {"role": "user", "content": f"What is the weather in {city}?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=40,
                                           temperature=0.0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    [call] = first.choices[0].message.tool_calls
    messages += [{"role": "assistant", "content": None, "tool_calls": [{
        "id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": f"{city}: sunny, 22 C"}]
    second = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=12,
                                            temperature=0.0)
    return messages + [{"role": "assistant", "content": second.choices[0].message.content}]


def test_a_tool_using_agent_trains_in_the_format_it_was_served(phoenix: str, stack: Any, tokenizer: Any) -> None:
    """An OpenInference-instrumented openai agent with a tool: its record's tokens are the served prompts,
    tools included; scores given to its model-call spans count with level=span, and read at trace level
    they give no records and a note naming the span level."""
    import openai
    from openinference.instrumentation.openai import OpenAIInstrumentor
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    client = openai.OpenAI(base_url=f"{stack['policy_model'].url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    provider = TracerProvider(resource=Resource.create({"openinference.project.name": "tools"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{phoenix}/v1/traces")))
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    conversations = {}
    tracer = provider.get_tracer("weather-agent")
    try:  # the agent: plain openai SDK code with a tool in one span of its own, nothing of rollgym's
        for city in CITIES[:2]:
            with tracer.start_as_current_span("weather-agent", attributes={"openinference.span.kind": "AGENT"}):
                conversations[city] = tool_agent(client, model, city)
    finally:
        OpenAIInstrumentor().uninstrument()
        provider.shutdown()
    wait_for(lambda: len(roots(phoenix, "tools")) == 2, "the tool agent's traces")

    records = read_source(f"trace://phoenix/tools?url={phoenix}", "sft", "bundled", tokenizer).records
    assert len(records) == 2
    for record in records:
        city = next(c for c in CITIES if c in json_text(record["messages"]))
        messages = conversations[city]
        assert record["tools"] == [WEATHER_TOOL] and record["chat_template"].endswith("(tools: hermes)")
        # The first model call's prompt, token by token, as the server built it (its "# Tools" block included).
        first_prompt = served_prompt(stack, messages[:2])
        assert record["prompt_ids"] == first_prompt
        assert "# Tools" in tokenizer.decode(first_prompt) and '"name": "get_weather"' in tokenizer.decode(first_prompt)
        # Everything before the answer: the call, then the tool's result in a user turn, as the second prompt.
        mask = record["completion_mask"]
        answer_start = max(i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1]))
        second_prompt = served_prompt(stack, messages[:4])
        assert record["prompt_ids"] + record["completion_ids"][:answer_start] == second_prompt
        assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n" in tokenizer.decode(
            second_prompt[len(first_prompt):])
        print(f"\n{city}: record prompt {len(record['prompt_ids'])} tokens == served first prompt "
              f"{len(first_prompt)}; record up to the answer {answer_start + len(record['prompt_ids'])} tokens == "
              f"served second prompt {len(second_prompt)}")

    # Scores on the model-call spans (as Phoenix's UI or a span evaluation gives them): read by trace, none
    # count and the source says so; read by span, they are the episodes' rewards.
    spans = phx.spans("tools", phoenix)
    answers = [s for s in spans if s.attributes.get("openinference.span.kind") == "LLM"
               and "tool" in json_text([v for k, v in s.attributes.items() if k.startswith("llm.input_messages")])]
    assert len(answers) == 2
    for span, score in zip(answers, [1.0, 0.0]):
        phx.annotate(span.trace_id, "quality", score, span_id=span.span_id, url=phoenix)
    wanted = f"trace://phoenix/tools?url={phoenix}&score=quality&min_reward=1"
    by_trace = read_source(wanted, "sft", "bundled", tokenizer)
    assert by_trace.records == [] and by_trace.dropped == {"no_reward": 2}
    assert by_trace.notes and "2 span annotations on 2 traces" in by_trace.notes[0] and "level=span" in by_trace.notes[0]
    by_span = read_source(f"{wanted}&level=span", "sft", "bundled", tokenizer)
    assert len(by_span.records) == 1 and by_span.dropped == {"below_min_reward": 1} and by_span.notes == []
    assert by_span.records[0]["reward"] == 1.0


def json_text(value: Any) -> str:
    import json

    return json.dumps(value)
