"""The learning-event schema written as OpenTelemetry spans and read back: hooks, emit(), the local store,
OTLP/JSON files, late rewards joined by episode id, and the spans Phoenix/LangFuse would ingest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the traces extra: pip install 'rollgym[traces]'")

from rollgym import traces
from rollgym.traces.assemble import assemble
from rollgym.traces.otlp import read_otlp_file


def run_agent(tracing: traces.Tracing, city: str) -> str:
    @tracing.tool
    def get_weather(city: str) -> str:
        if city == "Nowhere":
            raise ValueError("no such city")
        return f"sunny in {city}"

    with tracing.episode(task="weather", input=f"weather in {city}?", tags=["demo"], metadata={"user": "u1"}) as ep:
        with tracing.node("plan", input={"question": city}) as node:
            node.output({"city": city})
        ep.llm_call(traces.Step(kind="llm", name="smol", input={"messages": [{"role": "user", "content": city}]},
                                output={"messages": [{"role": "assistant", "content": None, "tool_calls": [
                                    {"id": "c1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]}]},
                                tokens=traces.TokenRecord(prompt_ids=[1, 2], completion_ids=[3, 4],
                                                          completion_logprobs=[-0.5, -0.25], model_version="base")))
        try:
            ep.answer(get_weather(city))
        except ValueError:
            ep.answer("I could not find it")
    return ep.id


def test_hooks_write_spans_that_assemble_to_episodes(tmp_path: Path) -> None:
    tracing = traces.Tracing(tmp_path / "store", otlp_file=tmp_path / "copy.jsonl")
    first, second = run_agent(tracing, "Paris"), run_agent(tracing, "Nowhere")
    # A reward that arrives later, from another process: its own trace, joined by the episode's id.
    later = traces.Tracing(tmp_path / "store")
    later.emit(traces.Event(episode_id=first, kind="reward", reward=traces.Reward(value=0.9, source="user")))
    later.emit(traces.Event(episode_id=second, kind="reward", reward=traces.Reward(value=0.0, source="judge",
                                                                                name="correct")))
    spans = read_otlp_file(tmp_path / "store" / "spans.jsonl")
    assert len({s.trace_id for s in spans}) == 4  # two episodes, two late rewards
    by_id = {t.episode.id: t for t in assemble(spans)}
    assert set(by_id) == {first, second}
    paris = by_id[first]
    assert paris.episode.task == "weather" and paris.episode.metadata == {"user": "u1"} and paris.tags == ["demo"]
    assert [s.kind for s in paris.steps] == ["node", "llm", "tool"]
    assert paris.steps[0].output == {"city": "Paris"}
    assert paris.steps[1].tokens.completion_logprobs == [-0.5, -0.25] and paris.token_source == "served"
    assert paris.steps[1].tool_calls == [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "c1"}]
    assert paris.steps[2].input == {"city": "Paris"} and paris.steps[2].ok
    assert paris.final_answer == "sunny in Paris" and paris.reward() == 0.9
    nowhere = by_id[second]
    assert not nowhere.steps[2].ok and "no such city" in nowhere.steps[2].error
    assert nowhere.rewards[0].name == "correct" and nowhere.reward("correct") == 0.0 and nowhere.reward("x") is None
    # The OTLP file copy holds the same spans (not the late rewards, written by the other Tracing).
    assert len(read_otlp_file(tmp_path / "copy.jsonl")) == len(spans) - 2


def test_spans_follow_the_openinference_and_genai_conventions(tmp_path: Path) -> None:
    tracing = traces.Tracing(tmp_path)
    run_agent(tracing, "Paris")
    spans = {s.name: s for s in read_otlp_file(tmp_path / "spans.jsonl")}
    root, llm, tool = spans["episode weather"], spans["smol"], spans["get_weather"]
    assert root.parent_id is None and llm.parent_id == tool.parent_id == root.span_id
    assert root.attributes["openinference.span.kind"] == "AGENT" and root.attributes["tag.tags"] == ["demo"]
    assert llm.attributes["openinference.span.kind"] == "LLM"
    assert llm.attributes["llm.input_messages.0.message.role"] == "user"
    assert llm.attributes["llm.output_messages.0.message.tool_calls.0.tool_call.function.name"] == "get_weather"
    assert llm.attributes["gen_ai.operation.name"] == "chat" and llm.attributes["gen_ai.usage.output_tokens"] == 2
    assert tool.attributes["tool.name"] == "get_weather" and json.loads(tool.attributes["input.value"]) == {"city": "Paris"}


def test_emit_without_hooks_and_the_genai_message_forms(tmp_path: Path) -> None:
    tracing = traces.Tracing(tmp_path)
    tracing.emit(traces.Event(episode_id="ep-1", kind="node_start", step=traces.Step(name="answer"), ts=100.0))
    tracing.emit(traces.Event(episode_id="ep-1", kind="node_end", ts=101.5,
                              step=traces.Step(name="answer", input={"q": 1}, output={"a": 2})))
    tracing.emit(traces.Event(episode_id="ep-1", kind="tool_call", ts=102.0,
                              step=traces.Step(name="calc", input={"x": 1}, output={"value": 2}, ok=False, error="boom")))
    tracing.emit(traces.Event(episode_id="ep-1", kind="reward", reward=traces.Reward(value=1.0)))
    [trace] = assemble(read_otlp_file(tmp_path / "spans.jsonl"))
    assert trace.episode.id == "ep-1" and [s.kind for s in trace.steps] == ["node", "tool"]
    assert trace.steps[0].lat_ms == 1500 and trace.steps[1].error == "boom" and trace.reward() == 1.0
    with pytest.raises(ValueError, match="event.reward"):
        tracing.emit(traces.Event(episode_id="ep-1", kind="reward"))
    # GenAI's own message attributes (another instrumentation's spans) read as OpenInference's do.
    from rollgym.traces.conventions import step_from

    step = step_from({"gen_ai.operation.name": "chat", "gen_ai.input.messages": json.dumps(
        [{"role": "user", "parts": [{"type": "text", "content": "hi"}]}]), "gen_ai.output.messages": json.dumps(
        [{"role": "assistant", "parts": [{"type": "tool_call", "id": "t", "name": "f", "arguments": {"a": 1}}]}])},
        "chat", 0, True, None, 5)
    assert step.input["messages"] == [{"role": "user", "content": "hi"}]
    assert step.tool_calls == [{"name": "f", "arguments": {"a": 1}, "id": "t"}]


def test_otlp_files_are_read_strictly(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"resourceSpans": []}\nnot json\n{"resourceSpans": []}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_otlp_file(bad)
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"resourceSpans": []}\n{"resourceSp')  # a writer that crashed mid-line
    assert read_otlp_file(torn) == []
