"""Traces → SFT records, preference pairs and trajectories, with their filters and honest token sources,
re-tokenized with the embedded model's real chat template."""

from __future__ import annotations

from typing import Any

import pytest

from rollgym.traces import Episode, Reward, Step, TokenRecord, Trace
from rollgym.traces.tokens import retokenize
from rollgym.traces.transforms import Filters, select, to_preferences, to_rollouts, to_sft, to_trajectories


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                                "required": ["city"]}}}


def foreign(episode: str, question: str, answer: str, *rewards: float, tool_ok: bool = True,
            score: str = "thumbs") -> Trace:
    """A trace of an agent rollgym never served: text only."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    steps = [Step(kind="llm", input={"messages": [{"role": "user", "content": question}], "tools": [WEATHER_TOOL]},
                  output={"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}),
             Step(kind="tool", name="get_weather", ok=tool_ok, output={"value": "sunny"}),
             Step(kind="llm", input={"tools": [WEATHER_TOOL], "messages": [
                 {"role": "user", "content": question}, {"role": "assistant", "content": None, "tool_calls": [call]},
                 {"role": "tool", "content": "sunny" if tool_ok else "Error: no such city", "tool_call_id": "c1"}]},
                  output={"messages": [{"role": "assistant", "content": answer}]})]
    return Trace(episode=Episode(id=episode, task="weather"), steps=steps, input=question, final_answer=answer,
                 rewards=[Reward(value=r, name=score) for r in rewards])


def served(episode: str, reward: float) -> Trace:
    """A trace rollgym served: two model calls with their exact tokens; the second extends the first."""
    first = TokenRecord(prompt_ids=[1, 2, 3], completion_ids=[4, 5], completion_logprobs=[-0.1, -0.2], model_version="v1")
    second = TokenRecord(prompt_ids=[1, 2, 3, 4, 5, 9, 9], completion_ids=[6], completion_logprobs=[-0.3],
                         model_version="v1")
    steps = [Step(kind="llm", input={"messages": [{"role": "user", "content": "q"}]},
                  output={"messages": [{"role": "assistant", "content": "a"}]}, tokens=first),
             Step(kind="llm", input={"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                                                  {"role": "tool", "content": "t"}]},
                  output={"messages": [{"role": "assistant", "content": "b"}]}, tokens=second)]
    return Trace(episode=Episode(id=episode), steps=steps, rewards=[Reward(value=reward)])


def model_text(tokenizer: Any, record: dict[str, Any], ids: str = "completion_ids", mask: str = "completion_mask") -> str:
    return tokenizer.decode([t for t, m in zip(record[ids], record[mask]) if m])


def test_sft_records_are_exact_when_served_and_retokenized_otherwise(tokenizer: Any) -> None:
    [record] = to_sft([served("s1", 1.0)], tokenizer=tokenizer)
    assert record["token_source"] == "served" and record["prompt_ids"] == [1, 2, 3]
    assert record["completion_ids"] == [4, 5, 9, 9, 6] and record["completion_mask"] == [1, 1, 0, 0, 1]
    [record] = to_sft([foreign("f1", "Weather in Paris?", "It is sunny.", 1.0)], tokenizer=tokenizer)
    assert record["token_source"] == "retokenized" and record["reward"] == 1.0
    assert record["tools"] == [WEATHER_TOOL] and record["chat_template"].endswith("(tools: hermes)")
    # As the model servers render it for SmolLM2's template (no tool support): the tools in a system
    # message, the call as a Hermes block, its result as a user turn of <tool_response>.
    prompt = tokenizer.decode(record["prompt_ids"])
    assert prompt.startswith("<|im_start|>system\n# Tools\n") and '{"name": "get_weather", "description"' in prompt
    assert prompt.endswith("</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    said = model_text(tokenizer, record)
    assert said.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>')
    assert "It is sunny." in said and "sunny" not in said.split("It is")[0]
    assert tokenizer.decode([t for t, m in zip(record["completion_ids"], record["completion_mask"]) if not m]) == (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # A template: the question and final answer only, as one exchange.
    [short] = to_sft([foreign("f1", "Weather in Paris?", "It is sunny.", 1.0)], tokenizer=tokenizer,
                     template={"system": "Be brief.", "user": "Q: {input}", "assistant": "{answer}"})
    assert short["messages"][0] == {"role": "system", "content": "Be brief."}
    assert model_text(tokenizer, short) == "It is sunny.<|im_end|>\n"
    with pytest.raises(ValueError, match="no assistant"):
        retokenize(tokenizer, [{"role": "user", "content": "hi"}])


def test_filters_count_every_dropped_trace() -> None:
    traces = [foreign("a", "q1", "x", 0.9), foreign("b", "q1", "y", 0.8), foreign("c", "q2", "z", 0.2),
              foreign("d", "q3", "w", 0.7, tool_ok=False), foreign("e", "q4", "v"),
              foreign("f", "q5", "kill them all", 1.0)]
    traces.append(foreign("g", "q6", "u", 1.0).model_copy(update={"ok": False}))
    filters = Filters(score="thumbs", min_reward=0.5, tool_success_only=True, dedupe=True, top_k=1,
                      drop_unsafe=lambda trace: "kill" in str(trace.final_answer))
    kept = select(traces, filters)
    assert [t.episode.id for t in kept] == ["a"]
    assert filters.dropped == {"failed": 1, "no_reward": 1, "below_min_reward": 1, "tool_error": 1, "unsafe": 1,
                               "duplicate_prompt": 1}
    assert [t.episode.id for t in select(traces, Filters(score="other", min_reward=0.0))] == []


def test_preference_pairs_by_input_gap_and_feedback(tokenizer: Any) -> None:
    group = [foreign(f"p{i}", "Weather in Paris?", answer, reward)
             for i, (answer, reward) in enumerate([("Sunny.", 1.0), ("Rain?", 0.0), ("Sunny, 20C.", 0.95),
                                                   ("No idea.", 0.5)])]
    other = [foreign("o1", "Weather in Rome?", "Hot.", 1.0)]  # alone with its prompt: no pair
    by_input = to_preferences(group + other, tokenizer=tokenizer, filters=Filters(score="thumbs"))
    assert [(p["chosen_rollout_id"], p["rejected_rollout_id"]) for p in by_input] == [("p0", "p1"), ("p2", "p3")]
    pair = by_input[0]
    assert pair["token_source"] == "retokenized" and pair["quality_difference"] == 1.0
    assert "Sunny." in model_text(tokenizer, pair, "chosen_ids", "chosen_mask")
    assert "Rain?" in model_text(tokenizer, pair, "rejected_ids", "rejected_mask")
    gaps = to_preferences(group, tokenizer=tokenizer, pair_by="reward_gap", min_gap=0.4, filters=Filters(score="thumbs"))
    assert {(p["chosen_rollout_id"], p["rejected_rollout_id"]) for p in gaps} == {
        ("p0", "p1"), ("p0", "p3"), ("p2", "p1"), ("p2", "p3"), ("p3", "p1")}
    feedback = to_preferences(group, tokenizer=tokenizer, pair_by="feedback", threshold=0.9,
                              filters=Filters(score="thumbs"))
    assert len(feedback) == 4 and {p["chosen_rollout_id"] for p in feedback} == {"p0", "p2"}
    with pytest.raises(ValueError, match="pair_by"):
        to_preferences(group, tokenizer=tokenizer, pair_by="vibes", filters=Filters(score="thumbs"))  # type: ignore[arg-type]


def test_trajectories_by_episode_or_steps_and_rollout_rows() -> None:
    traces = [foreign("t1", "q", "a", 1.0), served("s1", 0.5)]
    whole = to_trajectories(traces)
    assert [(t["episode_id"], len(t["steps"]), t["token_source"]) for t in whole] == [
        ("t1", 3, "retokenized"), ("s1", 2, "served")]
    windows = to_trajectories(traces, window=2)
    assert [(t["episode_id"], t["window"], t["final"]) for t in windows] == [
        ("t1", [0, 2], False), ("t1", [2, 4], True), ("s1", [0, 2], True)]
    with pytest.raises(ValueError, match="window"):
        to_trajectories(traces, window=0)
    rows = to_rollouts(traces)
    assert rows[0]["sequences"] == [] and rows[0]["token_source"] == "retokenized"
    assert rows[1]["sequences"][0]["completion_logprobs"] == [-0.1, -0.2, 0.0, 0.0, -0.3] and rows[1]["prefix_ok"]


def test_a_retokenized_record_is_the_prompt_the_embedded_model_builds(tokenizer: Any) -> None:
    """The record of a foreign tool-using trace, token for token, against llama.cpp's own rendering and
    tokenizer of the same messages and tools (the embedded model server's prompt, not rollgym's
    transformers path): the first call's prompt, and everything before the answer as the second call's."""
    pytest.importorskip("llama_cpp", reason="the embedded model needs llama-cpp-python (make install builds it)")
    from models.llamacpp.engine import LlamaEngine

    engine = LlamaEngine(n_ctx=2048, seed=0)
    trace = foreign("f1", "Weather in Paris?", "It is sunny.", 1.0)
    [record] = to_sft([trace], tokenizer=tokenizer)
    messages = trace.messages()
    first, _ = engine.prompt_token_ids(messages[:1], [WEATHER_TOOL])
    assert record["prompt_ids"] == first
    second, _ = engine.prompt_token_ids(messages[:3], [WEATHER_TOOL])
    mask = record["completion_mask"]
    answer = max(i for i in range(len(mask)) if mask[i] and not mask[i - 1])
    assert record["prompt_ids"] + record["completion_ids"][:answer] == second
