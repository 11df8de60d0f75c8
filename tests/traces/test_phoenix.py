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
    _, records = read_source(f"trace://phoenix/agent?url={phoenix}&score=thumbs&min_reward=1", "sft", "bundled",
                             tokenizer)
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
