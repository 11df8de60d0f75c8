"""Batched generation on a Hugging Face transformers model, with the token record RL trains on.

One worker thread owns the model (`BatchQueue`). It takes the requests waiting for it in waves: a
wave is the requests at the head of the queue that use the same weights (the base or one LoRA
adapter), at most `max_batch`; their prompts are left-padded into one batch, prefilled together and
decoded together with a KV cache, a row leaving the batch when it ends. Adapter loads and unloads
queue like requests, so a request keeps the weights it arrived under.

Sampling is done here, per row, rather than by `generate` or transformers' continuous batching:
each request brings its own temperature, top-p, top-k and seed (its draws come from its own
generator, so a seed reproduces a generation whatever else shares the wave), greedy and sampled
requests share a wave, and each token's logprob is read from the very distribution it was drawn
from. That distribution is the one vLLM and transformers sample from: logits / temperature, then
the top-k, then the top-p nucleus of what is left, renormalised (`processed` logprobs); `raw` mode
reports log-softmax of the logits instead. Greedy rows (temperature 0) report raw logprobs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import random
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rollgym.errors import ContextLengthError
from rollgym.sequences import extend_tokens

from .chat_format import call_closed, native_messages, plain_messages

__all__ = ["BatchQueue", "ContextLengthError", "Engine", "Generation", "GenerationRequest", "pick_device", "pick_dtype"]

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
    temperature: float = 1.0
    top_p: float = 1.0
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


class Engine:
    """A causal LM and its tokenizer on one device; `generate` runs one wave (one thread at a time)."""

    def __init__(self, model: Any, tokenizer: Any, *, n_ctx: int, seed: int = 0) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.n_ctx = n_ctx
        self.n_vocab = int(model.get_output_embeddings().weight.shape[0])
        self._rng = random.Random(seed)
        template = tokenizer.chat_template or ""
        self.native_tools = "tools" in template
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
        """A conversation as prompt text, through the tokenizer's chat template."""
        if self.native_tools:
            return self.tokenizer.apply_chat_template(native_messages(messages), tools=list(tools) if tools else None,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.tokenizer.apply_chat_template(plain_messages(messages, tools),
                                                  add_generation_prompt=add_generation_prompt, tokenize=False)

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

    # ------------------------------------------------------------------ generation

    @torch.inference_mode()
    def generate(self, requests: list[GenerationRequest]) -> list[Generation]:
        """Run one wave: every request uses the same weights (already selected)."""
        for request in requests:
            if len(request.prompt_ids) > self.n_ctx - 1:
                raise ContextLengthError(len(request.prompt_ids), self.n_ctx)
        device = self.device
        rows = len(requests)
        limits = [max(0, min(r.max_tokens, self.n_ctx - len(r.prompt_ids))) for r in requests]
        results = [Generation([], [], [] if r.forced_ids else None, "length") for r in requests]
        live = [i for i in range(rows) if limits[i] > 0]
        if not live:
            return results
        generators = [torch.Generator().manual_seed(r.seed if r.seed is not None else self.new_seed()) for r in requests]
        temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in requests], device=device)
        greedy = torch.tensor([r.temperature <= 0 for r in requests], device=device)
        top_p = torch.tensor([r.top_p for r in requests], device=device)
        top_k = [r.top_k for r in requests]
        stops = [[s for s in r.stop if s] for r in requests]
        pending = [collections.deque(r.forced_ids) for r in requests]  # tokens to force next, row by row
        closing = [bool(r.closing_ids) for r in requests]  # still waiting for its call to close

        width = max(len(requests[i].prompt_ids) for i in live)
        ids = torch.full((len(live), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(live), width), dtype=torch.long)
        for row, i in enumerate(live):
            prompt = requests[i].prompt_ids
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        from transformers import DynamicCache

        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self._cache_arg: cache})
        index = torch.tensor(live, device=device)
        while True:
            logits = out.logits[:, -1, :].float()
            tokens, logprobs, forced = self._pick(logits, index, temperature, greedy, top_p, top_k, generators,
                                                  [pending[i] for i in live])
            keep: list[int] = []
            chosen = tokens.tolist()  # one copy to the host per step
            for row, i in enumerate(live):
                token = chosen[row]
                result = results[i]
                result.token_ids.append(token)
                result.logprobs.append(logprobs[row])
                if result.forced is not None:
                    result.forced.append(forced[row])
                if closing[i] and not forced[row] and call_closed(self.detokenize(result.token_ids)):
                    closing[i] = False
                    pending[i].extend(requests[i].closing_ids)
                if token in self.eog_ids:
                    result.finish_reason = "stop"
                elif stops[i] and self._stopped(result, stops[i]):
                    result.finish_reason = "stop"
                elif len(result.token_ids) >= limits[i]:
                    result.finish_reason = "length"
                elif requests[i].cancel.is_set():
                    result.finish_reason = "abort"
                else:
                    keep.append(row)
            if not keep:
                return results
            if len(keep) < len(live):
                selected = torch.tensor(keep, device=device)
                for layer in cache.layers:
                    layer.batch_select_indices(selected)
                mask, positions, tokens = mask[selected], positions[selected], tokens[selected]
                live = [live[row] for row in keep]
                index = index[selected]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(input_ids=tokens.view(-1, 1), attention_mask=mask, position_ids=positions,
                             use_cache=True, **{self._cache_arg: cache})

    def _pick(self, logits: torch.Tensor, index: torch.Tensor, temperature: torch.Tensor, greedy: torch.Tensor,
              top_p: torch.Tensor, top_k: list[int], generators: list[torch.Generator],
              pending: list[collections.deque[int]]) -> tuple[torch.Tensor, list[float], list[int]]:
        """The next token of each live row, its logprob, and whether it was forced."""
        raw = torch.log_softmax(logits, dim=-1)
        processed = processed_logprobs(logits, temperature[index], top_p[index], [top_k[i] for i in index.tolist()])
        # One uniform draw per row from the row's own generator: a seed reproduces the row's tokens.
        uniform = torch.stack([torch.rand((), generator=generators[i]) for i in index.tolist()]).to(logits.device)
        cdf = processed.exp().cumsum(dim=-1)
        draws = uniform.clamp_min(1e-12).unsqueeze(-1) * cdf[:, -1:]
        sampled = torch.searchsorted(cdf, draws).squeeze(-1).clamp_max(logits.shape[-1] - 1)
        row_greedy = greedy[index]
        tokens = torch.where(row_greedy, logits.argmax(dim=-1), sampled)
        flags = []
        for row, queue in enumerate(pending):
            flags.append(int(bool(queue)))
            if queue:
                tokens[row] = queue.popleft()
        chosen = tokens.unsqueeze(-1)
        logprobs = torch.where(row_greedy, raw.gather(-1, chosen).squeeze(-1),
                               processed.gather(-1, chosen).squeeze(-1)).clamp_min(FLOOR_LOGPROB)
        return tokens, logprobs.tolist(), flags

    def _stopped(self, result: Generation, stops: list[str]) -> bool:
        text = self.detokenize([t for t in result.token_ids if t not in self.eog_ids])
        hits = [p for p in (text.find(s) for s in stops) if p >= 0]
        if hits:
            result.stop_cut = min(hits)
        return bool(hits)


def processed_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                       top_k: list[int]) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from, row by row: logits / temperature, the top-k,
    then the smallest set of the likeliest remaining tokens whose mass reaches top-p; -inf outside."""
    scores = logits / temperature.unsqueeze(-1)
    vocab = scores.shape[-1]
    if any(0 < k < vocab for k in top_k):
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=scores.device)
        kth = scores.sort(dim=-1, descending=True).values.gather(-1, (ks - 1).unsqueeze(-1))
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if bool((top_p < 1).any()):
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the likelier tokens
        drop = before >= top_p.unsqueeze(-1)
        drop[:, 0] = False
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(scores, dim=-1)


@dataclass
class _Job:
    request: GenerationRequest | None
    call: Callable[[], Any] | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


class BatchQueue:
    """The one thread that touches the model: waves of requests with the same weights, FIFO otherwise.

    `select(adapter)` is called on that thread before each wave to put the wave's weights in place."""

    def __init__(self, engine: Engine, select: Callable[[str | None], None], max_batch: int = 32) -> None:
        self.engine = engine
        self.select = select
        self.max_batch = max_batch
        self._jobs: collections.deque[_Job] = collections.deque()
        self._ready = threading.Condition()
        self._closed = False
        self.running = False
        self.waves = 0
        self.largest_wave = 0
        self._thread = threading.Thread(target=self._worker, name="transformers-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        return len(self._jobs)

    async def submit(self, request: GenerationRequest) -> Generation:
        try:
            return await self._put(request, None)
        except asyncio.CancelledError:
            request.cancel.set()  # a queued request is skipped, a running one leaves at its next token
            raise

    async def run(self, call: Callable[[], Any]) -> Any:
        """`call()` on the worker thread, after every request queued before it."""
        return await self._put(None, call)

    async def _put(self, request: GenerationRequest | None, call: Callable[[], Any] | None) -> Any:
        if self._closed:
            raise RuntimeError("the generation queue is closed")
        loop = asyncio.get_running_loop()
        job = _Job(request, call, loop, loop.create_future())
        with self._ready:
            self._jobs.append(job)
            self._ready.notify()
        return await job.future

    def close(self, timeout: float | None = None) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout)

    def _next_wave(self) -> list[_Job] | None:
        """The jobs to run next: one call, or the queued requests before the next call with the first one's weights."""
        with self._ready:
            while not self._jobs and not self._closed:
                self._ready.wait()
            if not self._jobs:
                return None
            if self._jobs[0].call is not None:
                return [self._jobs.popleft()]
            adapter = self._jobs[0].request.adapter  # type: ignore[union-attr]
            wave: list[_Job] = []
            for job in list(self._jobs):
                if job.call is not None or len(wave) >= self.max_batch:
                    break
                if job.request.adapter == adapter:  # type: ignore[union-attr]
                    wave.append(job)
                    self._jobs.remove(job)
            return wave

    def _worker(self) -> None:
        while (wave := self._next_wave()) is not None:
            if wave[0].call is not None:
                self._settle(wave, self._attempt(wave[0].call))
                continue
            wave = [job for job in wave if not (job.request.cancel.is_set() or job.future.done())]  # type: ignore[union-attr]
            if not wave:
                continue
            self.running = True
            self.waves += 1
            self.largest_wave = max(self.largest_wave, len(wave))
            requests = [job.request for job in wave]

            def run_wave() -> list[Generation]:
                self.select(requests[0].adapter)  # type: ignore[union-attr]
                return self.engine.generate(requests)  # type: ignore[arg-type]

            outcome = self._attempt(run_wave)
            self.running = False
            if isinstance(outcome, BaseException):
                self._settle(wave, outcome)
            else:
                for job, result in zip(wave, outcome):
                    self._settle([job], result)

    @staticmethod
    def _attempt(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as error:  # delivered to the awaiting request(s)
            return error

    @staticmethod
    def _settle(jobs: list[_Job], outcome: Any) -> None:
        def deliver(future: asyncio.Future[Any]) -> None:
            if future.done():
                return
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

        for job in jobs:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                job.loop.call_soon_threadsafe(deliver, job.future)
