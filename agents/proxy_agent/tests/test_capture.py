"""The capture's token arithmetic: restoring echoed turns, chains, branches and drift."""

from __future__ import annotations

from agents.proxy_agent.capture import Call, Capture


def generated(text: str, prompt: list[int], generation: list[int], **extra: object) -> dict:
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
            "prompt_token_ids": prompt, "generation_token_ids": generation,
            "generation_log_probs": [-0.5] * len(generation), **extra}


def user(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def test_an_echoed_turn_gets_its_tokens_back_only_in_its_own_context() -> None:
    capture = Capture([Call(input=[user("hi")], output=[generated("hello", [1, 2], [3, 4])])])
    echoed = [user("hi"), {"type": "message", "role": "assistant", "content": " hello"}, user("more")]
    restored = capture.restore_tokens(echoed)
    assert restored[1]["generation_token_ids"] == [3, 4] and restored[1]["prompt_token_ids"] == [1, 2]
    assert "generation_token_ids" not in echoed[1]  # the agent's own dicts are left alone
    elsewhere = capture.restore_tokens([user("another question"), {"type": "message", "role": "assistant",
                                                                   "content": "hello"}])
    assert "generation_token_ids" not in elsewhere[1]


def test_only_the_latest_echoed_turn_gets_its_tokens_back() -> None:
    first = Call(input=[user("hi")], output=[generated("hello", [1, 2], [3, 4])])
    second = Call(input=[user("hi"), generated("hello", [1, 2], [3, 4]), user("more")],
                  output=[generated("more text", [1, 2, 3, 4, 5], [6, 7])])
    capture = Capture([first, second])
    echoed = [user("hi"), {"type": "message", "role": "assistant", "content": "hello"}, user("more"),
              {"type": "message", "role": "assistant", "content": "more text"}, user("last")]
    restored = capture.restore_tokens(echoed)
    # The model server extends the last record of its input; the first turn's would only lengthen the request.
    assert restored[3]["prompt_token_ids"] == [1, 2, 3, 4, 5] and restored[3]["generation_token_ids"] == [6, 7]
    assert "prompt_token_ids" not in restored[1]
    # An agent that edited the latest turn: the turn before it is the latest one echoed, so it gets its record.
    edited = capture.restore_tokens([*echoed[:3], {"type": "message", "role": "assistant", "content": "other"}])
    assert edited[1]["generation_token_ids"] == [3, 4] and "generation_token_ids" not in edited[3]


def test_tool_call_arguments_match_whatever_the_sdk_spacing() -> None:
    call = {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
            "arguments": '{"city":"Paris"}', "prompt_token_ids": [1], "generation_token_ids": [2],
            "generation_log_probs": [-0.1]}
    capture = Capture([Call(input=[user("weather?")], output=[call])])
    echoed = [user("weather?"), {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                 "arguments": '{ "city": "Paris" }'}]
    assert capture.restore_tokens(echoed)[1]["generation_token_ids"] == [2]


def test_branches_become_separate_sequences_and_drift_is_flagged() -> None:
    first = Call(input=[user("a")], output=[generated("x", [1, 2], [3])])
    follow = Call(input=[user("a"), {"type": "message", "role": "assistant", "content": "x"}, user("b")],
                  output=[generated("y", [1, 2, 3, 9, 9], [4])])
    side = Call(input=[user("sub-task")], output=[generated("z", [7, 7], [8])])
    sequences, ok = Capture([first, side, follow]).sequences()
    assert ok is True and len(sequences) == 2
    main, branch = sequences
    assert main["prompt_ids"] == [1, 2] and main["completion_ids"] == [3, 9, 9, 4]
    assert main["completion_mask"] == [1, 0, 0, 1] and main["prefix_ok"] is True
    assert branch["prompt_ids"] == [7, 7] and branch["prefix_ok"] is True

    drifted = Call(input=follow.input, output=[generated("y", [1, 5, 3, 9], [4])])  # same talk, other tokens
    sequences, ok = Capture([first, drifted]).sequences()
    assert ok is False and [s["prefix_ok"] for s in sequences] == [True, False]


def test_transcript_interleaves_tool_outputs_once() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}",
            "prompt_token_ids": [1], "generation_token_ids": [2], "generation_log_probs": [-0.1]}
    output = {"type": "function_call_output", "call_id": "c1", "output": "sunny"}
    calls = [Call(input=[user("q")], output=[call]),
             Call(input=[user("q"), call, output], output=[generated("sunny", [1, 2, 5], [6])]),
             Call(input=[user("q"), call, output, user("again")], output=[generated("ok", [1, 2, 5, 6, 7], [8])])]
    kinds = [item["type"] for item in Capture(calls).transcript()]
    assert kinds == ["function_call", "function_call_output", "message", "message"]
