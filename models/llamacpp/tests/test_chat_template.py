"""The embedded model's `chat_template` option: what it accepts, the errors that name it, and the rule of the
built-in `qwen3_style` template (earlier reasoning dropped at each new user turn). No model is loaded here;
tests/train/loop/test_stripped_reasoning_embedded.py runs a train epoch on the real model with it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install -e '.[llamacpp]')")

from models.llamacpp.chat_format import CHATML_TEMPLATE, compile_template, template_source  # noqa: E402
from rollgym.config import load_stack  # noqa: E402
from rollgym.errors import ServerStartError  # noqa: E402
from rollgym.stack.serve import build_server  # noqa: E402

CONFIG = "models/llamacpp/configs/llamacpp.yaml"
KEY = "policy_model.models.llamacpp"


def start_error(*overrides: str) -> str:
    """The message a stack start gives for the embedded model configured with `overrides`."""
    spec = load_stack([CONFIG], list(overrides)).servers["policy_model"]
    with pytest.raises(ServerStartError) as caught:
        build_server(spec, {"registry": {}, "secret": "s" * 32})
    return str(caught.value)


def render(messages: list[dict], **variables: object) -> str:
    template, uses_tools = compile_template(template_source("qwen3_style"))
    assert not uses_tools  # tools reach it lowered to text, like SmolLM2's own template
    return template.render(messages=messages, add_generation_prompt=True, **variables)


def test_bad_chat_template_settings_name_the_key(tmp_path: Path) -> None:
    assert f"key '{KEY}.chat_template': 'qwen3' is no built-in template (chatml, qwen3_style) and no file" \
        in start_error("policy_model.chat_template=qwen3")
    missing = tmp_path / "missing.jinja"
    assert f"no file (not found: {missing})" in start_error(f"policy_model.chat_template={missing}")
    assert f"no file (not a file: {tmp_path})" in start_error(f"policy_model.chat_template={tmp_path}")
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}{{ message.content }}")
    assert f"key '{KEY}.chat_template': {broken} is no valid Jinja template: Unexpected end of template" \
        in start_error(f"policy_model.chat_template={broken}")
    assert f"key '{KEY}.chat_template_kwargs': add_generation_prompt, messages: set by the server" \
        in start_error("policy_model.chat_template_kwargs={messages: [], add_generation_prompt: false}")


def test_a_chat_template_is_a_built_in_a_file_or_the_text(tmp_path: Path) -> None:
    assert template_source("chatml") == CHATML_TEMPLATE
    assert "last_query" in template_source("qwen3_style")
    custom = tmp_path / "custom.jinja"
    custom.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert template_source(str(custom)) == custom.read_text()
    assert template_source("{{ messages[0].content }}") == "{{ messages[0].content }}"
    spec = load_stack([CONFIG], [f"policy_model.chat_template={custom}",
                                 "policy_model.chat_template_kwargs={enable_thinking: false}"]).servers["policy_model"]
    config = build_server(spec, {"registry": {}, "secret": "s" * 32}).config
    assert config.chat_template == str(custom) and config.chat_template_kwargs == {"enable_thinking": False}


def test_qwen3_style_keeps_reasoning_only_after_the_last_user_message() -> None:
    turn = {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\nsunny"}
    within = [{"role": "user", "content": "weather?"}, turn,
              {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}]  # a tool result, lowered
    assert "<|im_start|>assistant\n<think>\nlook it up\n</think>\n\nsunny<|im_end|>" in render(within)
    after = [*within, {"role": "user", "content": "tomorrow?"}]
    assert "<think>" not in render(after) and "<|im_start|>assistant\nsunny<|im_end|>" in render(after)
    # Reasoning given as reasoning_content renders as the same block, and goes the same way.
    as_field = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": "sunny", "reasoning_content": "look it up"}]
    assert render(as_field) == render(within[:2])
    assert render([*as_field, {"role": "user", "content": "tomorrow?"}]) == render([*within[:2], after[-1]])


def test_qwen3_style_without_thinking_opens_each_answer_with_an_empty_block() -> None:
    first = [{"role": "user", "content": "hi"}]
    assert render(first).endswith("<|im_start|>assistant\n")
    assert render(first, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    answered = [*first, {"role": "assistant", "content": "hello"}]
    # The answer as sampled (after the block) while no user message follows it, without the block once one does.
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\nhello<|im_end|>\n" in render(answered)
    later = render([*answered, {"role": "user", "content": "bye"}], enable_thinking=False)
    assert "<|im_start|>assistant\nhello<|im_end|>\n" in later and later.count("<think>") == 1
