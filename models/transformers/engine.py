"""A Hugging Face transformers model and its tokenizer, with the token record RL trains on: prompts
(chat templates, the next turn built on the previous turn's exact tokens) and per-row sampling.

Sampling is done here, per row, rather than by `generate` or transformers' continuous batching:
each request brings its own temperature, top-p, top-k and seed (its draws come from its own
generator, so a seed reproduces a generation whatever else shares the batch), greedy and sampled
requests share a batch, forced tokens (a named tool call) are put in place of a draw, and each
token's logprob is read from the very distribution it was drawn from. That distribution is the one
vLLM and transformers sample from: logits / temperature, then the top-k, then the top-p nucleus of
what is left, renormalised (`processed` logprobs). Greedy rows (temperature 0) report raw logprobs.
The batching itself is batching.py.
"""

from __future__ import annotations

import collections
import inspect
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollgym.errors import ContextLengthError
from rollgym.sampling_contract import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from rollgym.sequences import extend_tokens
from rollgym.tool_calls import render_chat

__all__ = ["ContextLengthError", "Engine", "Generation", "GenerationRequest", "pick_device", "pick_dtype"]

FLOOR_LOGPROB = -103.616  # log(1e-45), as the embedded model clamps: a forced token outside the sampled support


def pick_device(name: str) -> torch.device:
    """`auto`: cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on cuda, fp32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


@dataclass
class GenerationRequest:
    """One generation: exact prompt ids, sampling, the forced opening tokens, the adapter key (None: base)."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = DEFAULT_TOP_P
    top_k: int = 0
    seed: int | None = None
    forced_ids: list[int] = field(default_factory=list)
    closing_ids: list[int] = field(default_factory=list)  # forced once a forced call's JSON object is complete
    stop: list[str] = field(default_factory=list)
    adapter: str | None = None
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    forced: list[int] | None
    finish_reason: str  # stop | length | abort
    stop_cut: int | None = None  # characters of the decoded text before a matched stop string
    first_token_at: float | None = None  # time.perf_counter() when its first token was picked (time to first token)
    version: str | None = None  # the base weights' model_version when it joined the batch (Scheduler's `version`)


class Engine:
    """A causal LM and its tokenizer on one device (used by one thread at a time: batching.Scheduler)."""

    def __init__(self, model: Any, tokenizer: Any, *, n_ctx: int, seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.n_ctx = n_ctx
        self.n_vocab = int(model.get_output_embeddings().weight.shape[0])
        self._rng = random.Random(seed)
        eos = model.generation_config.eos_token_id
        eog = {*(eos if isinstance(eos, list) else [eos] if eos is not None else []), tokenizer.eos_token_id}
        for text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>"):
            token = tokenizer.convert_tokens_to_ids(text)
            if isinstance(token, int) and token != tokenizer.unk_token_id and token is not None and token >= 0:
                eog.add(token)
        self.eog_ids = frozenset(t for t in eog if t is not None)
        # The text that closes an assistant turn in the template (ChatML, Llama 3, Gemma), if it is one token.
        self.end_of_turn = next((text for text in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
                                 if self.tokenize(text) and len(self.tokenize(text)) == 1
                                 and self.tokenize(text)[0] in self.eog_ids), None)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eog_ids)
        self.adapter_keys: set[str] = set()
        # What ends a forced call once its JSON object is complete: the close tag and the end of the turn.
        self.closing_ids = self.tokenize("\n</tool_call>") + ([self.tokenize(self.end_of_turn)[0]]
                                                               if self.end_of_turn else [])
        # transformers renamed `past_key_values` to `cache` (5.2x); the GPU image may have either.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    # ------------------------------------------------------------------ prompts

    def render_text(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                    add_generation_prompt: bool = True) -> str:
        """A conversation as prompt text, through the tokenizer's chat template (the kernel's rendering, which
        traces re-tokenized for training share)."""
        return render_chat(self.tokenizer, messages, tools, add_generation_prompt)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
               add_generation_prompt: bool = True) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template."""
        return self.tokenize(self.render_text(messages, tools, add_generation_prompt))

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special)

    def prompt_ids(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                   previous: tuple[Any, list[dict[str, Any]]] | None = None) -> tuple[list[int], bool]:
        """(prompt ids, prefix_ok). With the previous turn's (TokenRecord, messages up to its assistant turn),
        the prompt is its prompt + generation + exactly the tokens the new messages add.

        As the embedded model does it: when the template's text up to that assistant turn is a prefix of the
        conversation's text, the new tokens are those of the text after the turn's end-of-turn marker (at the
        marker when the model never produced it: cut off by the token budget). Otherwise the three renders are
        aligned by tokens (`rollgym.sequences.extend_tokens`); failing that, the whole conversation is rendered
        afresh and prefix_ok is False."""
        full_text = self.render_text(messages, tools, True)
        if previous is None:
            return self.tokenize(full_text), True
        record, head_messages = previous
        head_text = self.render_text(head_messages, tools, False)
        position = head_text.rfind(self.end_of_turn) if self.end_of_turn else -1
        if full_text.startswith(head_text) and position >= 0:
            closed = bool(record.generation) and record.generation[-1] in self.eog_ids
            delta = full_text[position + len(self.end_of_turn) if closed else position:]
            return [*record.prompt, *record.generation, *self.tokenize(delta)], True
        base = self.render(head_messages[:-1], tools, True)
        extended = extend_tokens(record.prompt, record.generation, self.tokenize(head_text), self.tokenize(full_text),
                                 base=base)
        return (extended, True) if extended is not None else (self.tokenize(full_text), False)

    def new_seed(self) -> int:
        return self._rng.getrandbits(31)

    # ------------------------------------------------------------------ sampling

    def pick(self, logits: torch.Tensor, requests: list[GenerationRequest], generators: list[torch.Generator],
             pending: list[collections.deque[int]]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """The next token of each row (on the device), its logprob, and whether it was forced (popped from
        `pending`). No copy to the host: the caller copies tokens and logprobs once."""
        device, vocab = logits.device, logits.shape[-1]
        greedy_rows = [r.temperature <= 0 for r in requests]
        temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in requests], device=device)
        top_p = [r.top_p for r in requests]
        # One uniform draw per row from the row's own generator: a seed reproduces the row's tokens.
        uniform = torch.stack([torch.rand((), generator=g) for g in generators]).to(device).clamp_min(1e-12)
        plain = all(p >= 1 for p in top_p) and not any(0 < r.top_k < vocab for r in requests)
        if plain:
            # Nothing truncated: the distribution is softmax(logits / T); only the chosen tokens' logprobs are read.
            scores = logits / temperature.unsqueeze(-1)
            peak = scores.amax(dim=-1, keepdim=True)
            cdf = (scores - peak).exp_().cumsum_(dim=-1)
            norm = peak + cdf[:, -1:].log()
            logprob_of = lambda chosen: (scores.gather(-1, chosen) - norm).squeeze(-1)  # noqa: E731
        else:
            processed = processed_logprobs(logits, temperature, torch.tensor(top_p, device=device),
                                           [r.top_k for r in requests], top_p_host=top_p)
            cdf = processed.exp().cumsum(dim=-1)
            logprob_of = lambda chosen: processed.gather(-1, chosen).squeeze(-1)  # noqa: E731
        tokens = torch.searchsorted(cdf, uniform.unsqueeze(-1) * cdf[:, -1:]).squeeze(-1).clamp_max(vocab - 1)
        greedy = torch.tensor(greedy_rows, device=device)
        if any(greedy_rows):
            tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
        flags = [int(bool(queue)) for queue in pending]
        if any(flags):
            forced = torch.tensor([queue.popleft() if queue else 0 for queue in pending], device=device)
            tokens = torch.where(torch.tensor(flags, device=device, dtype=torch.bool), forced, tokens)
        chosen = tokens.unsqueeze(-1)
        logprobs = logprob_of(chosen)
        if any(greedy_rows) and not plain:  # greedy rows report raw logprobs (T = 1 makes the plain ones raw)
            logprobs = torch.where(greedy, torch.log_softmax(logits, dim=-1).gather(-1, chosen).squeeze(-1), logprobs)
        return tokens, logprobs.clamp_min(FLOOR_LOGPROB), flags

    def stopped(self, result: Generation, stops: list[str]) -> bool:
        """Whether the decoded text holds a stop string (its position goes to `stop_cut`)."""
        text = self.detokenize([t for t in result.token_ids if t not in self.eog_ids])
        hits = [p for p in (text.find(s) for s in stops) if p >= 0]
        if hits:
            result.stop_cut = min(hits)
        return bool(hits)


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       top_k: list[int], top_p_host: list[float] | None = None) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from, row by row: logits / temperature, the top-k,
    then the smallest set of the likeliest remaining tokens whose mass reaches top-p; -inf outside.
    `top_p_host`: the same top-p values as a list, which spares a copy from the device."""
    scores = logits / temperature.unsqueeze(-1)
    vocab = scores.shape[-1]
    if any(0 < k < vocab for k in top_k):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=scores.device)
        kth = scores.sort(dim=-1, descending=True).values.gather(-1, (ks - 1).unsqueeze(-1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if (any(p < 1 for p in top_p_host) if top_p_host is not None else bool((top_p < 1).any())):
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the likelier tokens
        drop = before >= top_p.unsqueeze(-1)
        drop[:, 0] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(scores, dim=-1)
