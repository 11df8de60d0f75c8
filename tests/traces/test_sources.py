"""Sources a plan stage reads: the local store and OTLP files, dataset://hf, LangFuse's public API (its
recorded shapes, served over real HTTP and read by the langfuse SDK's own client), and what each gives the
trainer by data kind, GRPO's refusal of re-tokenized episodes included."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

pytest.importorskip("opentelemetry.sdk", reason="the traces extra: pip install 'rollgym[traces]'")

from rollgym import traces
from rollgym.traces.sources import SourceError, parse, read_source, read_traces


def weather_store(folder: Path) -> list[str]:
    """Four episodes of two questions, rewards joined later; the Paris ones were served (token ids)."""
    tracing = traces.Tracing(folder)
    ids = []
    for city, answer, served in [("Paris", "Sunny in Paris.", True), ("Paris", "No idea.", True),
                                 ("Rome", "Hot in Rome.", False), ("Rome", "Cold?", False)]:
        with tracing.episode(task="weather", input=f"Weather in {city}?") as ep:
            tokens = traces.TokenRecord(prompt_ids=[1, 2, len(city)], completion_ids=[7, len(answer)],
                                        completion_logprobs=[-0.1, -0.2], model_version="base") if served else None
            ep.llm_call(traces.Step(kind="llm", input={"messages": [{"role": "user", "content": f"Weather in {city}?"}]},
                                    output={"messages": [{"role": "assistant", "content": answer}]}, tokens=tokens))
            ep.answer(answer)
        ids.append(ep.id)
    later = traces.Tracing(folder)
    for episode, reward in zip(ids, [1.0, 0.0, 1.0, 0.2]):
        later.emit(traces.Event(episode_id=episode, kind="reward", reward=traces.Reward(value=reward, name="thumbs")))
    return ids


def test_trace_sources_give_each_trainer_its_records(tmp_path: Path, tokenizer: Any) -> None:
    ids = weather_store(tmp_path / "store")
    uri = f"trace://local/{tmp_path}/store"
    assert [t.reward("thumbs") for t in read_traces(uri)] == [1.0, 0.0, 1.0, 0.2]
    sft = read_source(f"{uri}?score=thumbs&min_reward=1", "sft", "bundled", tokenizer)
    records = sft.records
    assert sft.rows == [] and [(r["rollout_id"], r["token_source"]) for r in records] == [
        (ids[0], "served"), (ids[2], "retokenized")]
    assert sft.dropped == {"below_min_reward": 2} and sft.notes == []  # the source says what it left out
    assert records[0]["completion_ids"] == [7, 15] and records[0]["completion_mask"] == [1, 1]
    assert records[0]["chat_template"] is None and records[1]["chat_template"].endswith("(tools: hermes)")
    pairs = read_source(f"{uri}?score=thumbs", "preferences", "bundled", tokenizer).records
    assert [(p["chosen_rollout_id"], p["rejected_rollout_id"], p["token_source"]) for p in pairs] == [
        (ids[0], ids[1], "served"), (ids[2], ids[3], "retokenized")]
    # GRPO trains on served tokens and sampling logprobs: re-tokenized episodes are refused unless named.
    with pytest.raises(SourceError, match=r"2 of 4 episodes have no served token ids.*allow_retokenized"):
        read_source(f"{uri}?score=thumbs", "groups", "bundled", tokenizer)
    rows = read_source(f"trace://otlp/{tmp_path}/store/spans.jsonl?score=thumbs&allow_retokenized=true",
                       "groups", "bundled", tokenizer).rows
    assert [r["token_source"] for r in rows] == ["served", "served", "retokenized", "retokenized"]
    assert rows[0]["sequences"][0]["completion_logprobs"] == [-0.1, -0.2] and rows[0]["reward"] == 1.0
    # A rollouts file is still what it was: rows for curation.
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps({"rollout_id": "r1", "reward": 1.0}) + "\n")
    replay = read_source(str(rollouts), "sft", "bundled")
    assert (replay.rows, replay.records) == ([{"rollout_id": "r1", "reward": 1.0}], [])


@pytest.mark.parametrize("uri, message", [
    ("trace://jaeger/x", "not a source rollgym reads"), ("trace://otlp/", "name the file"),
    ("trace://local/nowhere", "no such file"), ("trace://phoenix/p?colour=red", "unknown option colour"),
    ("trace://local/x?top_k=many", "top_k='many' is not a number"),
    ("trace://phoenix/p?level=episode", "level='episode': use trace or span"),
    ("trace://local/x?level=span", "level=span: only trace://phoenix/"),
    ("trace://phoenix/p?url=http://127.0.0.1:9", "Phoenix is not reachable"),
    ("trace://langfuse/p", "LANGFUSE_PUBLIC_KEY"),
    ("dataset://hf/rollgym-no-such-dataset:train", "dataset://hf/rollgym-no-such-dataset:train: no such dataset"),
])
def test_bad_sources_are_named(uri: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("LANGFUSE_PUBLIC_KEY", "LANGFUSE_SECRET_KEY", "LANGFUSE_BASE_URL", "LANGFUSE_HOST"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(SourceError, match=message):
        source = parse(uri)
        if "top_k" in uri:
            from rollgym.traces.sources import filters_of

            filters_of(source)
        read_traces(source)


def test_dataset_hf_reads_a_saved_dataset(tmp_path: Path, tokenizer: Any) -> None:
    datasets = pytest.importorskip("datasets")
    chats = datasets.Dataset.from_list([
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "reward": 1.0},
        {"messages": [{"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "7"}], "reward": 0.0}])
    prefs = datasets.Dataset.from_list([{"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Rome."}])
    datasets.DatasetDict({"train": chats, "test": chats.select([1])}).save_to_disk(str(tmp_path / "chats"))
    prefs.save_to_disk(str(tmp_path / "prefs"))
    records = read_source(f"dataset://hf/{tmp_path}/chats:train?min_reward=1", "sft", "bundled", tokenizer).records
    assert len(records) == 1 and records[0]["token_source"] == "retokenized"
    assert tokenizer.decode(records[0]["completion_ids"]) == "4<|im_end|>\n"
    assert [t.reward() for t in read_traces(f"dataset://hf/{tmp_path}/chats:test")] == [0.0]
    pairs = read_source(f"dataset://hf/{tmp_path}/prefs", "preferences", "bundled", tokenizer).records
    assert len(pairs) == 1 and tokenizer.decode(pairs[0]["chosen_ids"]).startswith("Paris.")
    with pytest.raises(SourceError, match="no split 'validation'"):
        read_traces(f"dataset://hf/{tmp_path}/chats:validation")


# ----------------------------------------------------------------------------------------------- LangFuse

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def langfuse_events() -> list[traces.Event]:
    step = traces.Step(idx=1, kind="llm", name="smol", lat_ms=120,
                       input={"messages": [{"role": "user", "content": "Weather in Paris?"}]},
                       output={"messages": [{"role": "assistant", "content": "Sunny."}]},
                       tokens=traces.TokenRecord(prompt_ids=[1, 2], completion_ids=[3], completion_logprobs=[-0.5],
                                                 model_version="base"))
    tool = traces.Step(idx=2, kind="tool", name="get_weather", input={"city": "Paris"}, output={"value": "sunny"},
                       ok=False, error="timeout", tool_calls=[{"name": "x", "arguments": {}}])
    return [traces.Event(episode_id="t1", kind="llm_call", step=step, tags=["prod"], ts=1000.123456789),
            traces.Event(episode_id="t1", kind="tool_call", step=tool, tags=["prod"], ts=1000.5),
            traces.Event(episode_id="t1", kind="episode_end", tags=["prod"], ts=1001.0, step=traces.Step(
                kind="node", name="weather", input={"value": "Weather in Paris?"}, output={"value": "Sunny."})),
            traces.Event(episode_id="t1", kind="reward", ts=1002.0,
                         reward=traces.Reward(value=0.75, source="user", name="thumbs", comment="good"))]


def test_langfuse_round_trip_is_the_identity(langfuse_events: list[traces.Event]) -> None:
    pytest.importorskip("langfuse")
    from langfuse.api import ObservationV2, ScoreV3_Numeric
    from langfuse.api.core.pydantic_utilities import parse_obj_as

    from rollgym.traces.langfuse import event_of, observation_of, score_of

    for i, event in enumerate(langfuse_events):
        item = score_of(event, score_id=f"s{i}") if event.kind == "reward" else observation_of(event, observation_id=f"o{i}")
        assert isinstance(item, ScoreV3_Numeric if event.kind == "reward" else ObservationV2)
        wire = json.loads(item.json())  # what LangFuse's API sends, parsed back by the SDK's type
        again = parse_obj_as(type(item), wire)  # as the SDK's client parses a response
        assert event_of(again) == event
    assert observation_of(langfuse_events[0], observation_id="o").type == "GENERATION"
    assert observation_of(langfuse_events[1], observation_id="o").level == "ERROR"


@pytest.fixture
def langfuse_server(langfuse_events: list[traces.Event]) -> Iterator[str]:
    """LangFuse's public API as recorded shapes (no LangFuse server can run here): observations (rollgym's
    and a foreign OpenAI generation without metadata.rollgym) and scores, behind basic auth."""
    pytest.importorskip("langfuse")
    from rollgym.traces.langfuse import observation_of, score_of

    observations = [json.loads(observation_of(e, observation_id=f"o{i}").json()) | {"traceName": "weather"}
                    for i, e in enumerate(langfuse_events) if e.kind != "reward"]
    observations.append({"id": "f1", "traceId": "t2", "projectId": "p", "type": "GENERATION", "name": "openai.chat",
                         "startTime": "2026-11-27T10:00:00Z", "endTime": "2026-11-27T10:00:01.5Z", "model": "gpt-x",
                         "parentObservationId": "root2", "level": "DEFAULT", "tags": ["prod"], "traceName": "weather",
                         "input": json.dumps([{"role": "user", "content": "Weather in Rome?"}]),
                         "output": json.dumps({"role": "assistant", "content": "Hot."}), "metadata": {}})
    observations.append({"id": "x1", "traceId": "t3", "projectId": "p", "type": "SPAN", "startTime": "2026-11-27T10:00:00Z",
                         "tags": ["dev"], "traceName": "weather", "input": "\"hi\"", "output": "\"yo\""})
    scores = [json.loads(score_of(e, score_id="s1").json()) for e in langfuse_events if e.kind == "reward"]
    app = FastAPI()
    seen: list[dict[str, Any]] = []

    @app.get("/api/public/v2/observations")
    async def observations_page(request: Request) -> Any:
        seen.append(dict(request.query_params))
        if request.headers.get("authorization", "")[:6] != "Basic ":
            return JSONResponse({"message": "unauthorized"}, status_code=401)
        start = int(request.query_params.get("cursor") or 0)
        page = observations[start:start + 2]  # two a page: the reader follows the cursor
        return {"data": page, "meta": {"cursor": str(start + 2) if start + 2 < len(observations) else None}}

    @app.get("/api/public/v3/scores")
    async def scores_page(request: Request) -> Any:
        trace_id = request.query_params.get("traceId")
        return {"data": [s for s in scores if s["subject"]["id"] == trace_id], "meta": {"cursor": None, "limit": 100}}

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    app.state.seen = seen
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)


def test_trace_langfuse_reads_observations_and_scores(langfuse_server: str, monkeypatch: pytest.MonkeyPatch,
                                                      tokenizer: Any) -> None:
    monkeypatch.setenv("LANGFUSE_PUBLIC_KEY", "pk-lf-test")
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "sk-lf-test")
    monkeypatch.setenv("LANGFUSE_BASE_URL", langfuse_server)
    found = {t.episode.id: t for t in read_traces("trace://langfuse/demo/weather?tag=prod")}
    assert set(found) == {"t1", "t2"}  # t3 is tagged dev
    ours, foreign = found["t1"], found["t2"]
    assert [s.kind for s in ours.steps] == ["llm", "tool"] and ours.steps[0].tokens.completion_logprobs == [-0.5]
    assert ours.reward("thumbs") == 0.75 and ours.final_answer == "Sunny." and ours.token_source == "served"
    assert foreign.steps[0].name == "gpt-x" and foreign.steps[0].lat_ms == 1500
    assert foreign.messages() == [{"role": "user", "content": "Weather in Rome?"}, {"role": "assistant", "content": "Hot."}]
    records = read_source("trace://langfuse/demo/weather?tag=prod", "sft", "bundled", tokenizer).records
    assert [r["token_source"] for r in records] == ["served", "retokenized"]
    monkeypatch.setenv("LANGFUSE_SECRET_KEY", "")
    with pytest.raises(SourceError, match="LANGFUSE_SECRET_KEY"):
        read_traces("trace://langfuse/demo")
