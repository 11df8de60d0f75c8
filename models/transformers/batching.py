"""Continuous batching on a transformers model: a request joins the running batch at the next step.

One worker thread owns the model (`Scheduler`). Its K/V live in a `SlotCache`: `max_batch` slots of
`slot_tokens` positions each, allocated once (the token budget), the running requests in slots
0..n-1. Each step the worker admits waiting requests into free slots (their prompts packed into one
forward pass, one block of causal attention each, the first token sampled from its last position),
then decodes one token for every running request in one forward pass over the model's own layers,
with each row's position and an attention mask of its own length. A row that ends gives its slot to
the last row (one copy of its K/V), so the running rows stay one contiguous slice of the cache.

Sampling is the engine's (engine.py: per-request seed, temperature, top-k, top-p, forced tokens,
the logprob of the distribution sampled from), and a step copies its tokens and logprobs to the host
once. Requests under different weights (the base, a LoRA adapter) do not share a step: a batch
admits requests in arrival order while they have its weights, and the next weights start when it
drains. Calls (adapter
loads, scoring, a weight reload) wait for the running batch to drain and run alone, in FIFO order
with the requests. At most `max_queue` requests wait; past that `submit` raises `QueueFull`.
Every step and call runs with fp32 matmuls in full fp32 (not TF32), whatever a trainer sharing the
process set for its own steps (rollgym.matmul_precision).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rollgym.errors import ContextLengthError
from rollgym.local_model import deliver
from rollgym.matmul_precision import FULL, fp32_matmuls

from .chat_format import call_closed
from .engine import Engine, Generation, GenerationRequest

__all__ = ["QueueFull", "Scheduler", "SlotCache"]


class QueueFull(RuntimeError):
    """Every slot is busy and `max_queue` requests already wait; `retry_after_s` is a fair guess."""

    def __init__(self, waiting: int, retry_after_s: float) -> None:
        super().__init__(f"the server is at capacity: {waiting} requests are waiting for a slot")
        self.retry_after_s = retry_after_s


class SlotCache:
    """Keys and values of `slots` sequences of up to `length` tokens, per layer, allocated once.

    Passed to the model as its cache. In `prefill` mode a packed forward writes each token's K/V at
    (`rows[i]`, `positions[i]`) and attends within the packed input; in decode mode the running rows
    0..n-1 write their new token at their own position and attend to the first `span` positions."""

    def __init__(self, model: Any, slots: int, length: int) -> None:
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        parameter = next(model.parameters())
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        shape = (config.num_hidden_layers, slots, kv_heads, length, head_dim)
        # Left unfilled (on the CPU, memory then grows with what is written): a position is zeroed the first
        # time a step reads it unwritten (`cover`), since a masked NaN would still poison attention.
        self.keys = torch.empty(shape, dtype=parameter.dtype, device=parameter.device)
        self.values = torch.empty(shape, dtype=parameter.dtype, device=parameter.device)
        self.slots, self.length = slots, length
        self.valid = [0] * slots  # positions of each slot that hold numbers (written or zeroed)
        self.prefill = False
        self.rows = torch.zeros(0, dtype=torch.long)
        self.positions = torch.zeros(0, dtype=torch.long)
        self.span = 0

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.prefill:  # key: [1, heads, tokens, dim]
            keys[self.rows, :, self.positions] = key[0].transpose(0, 1)
            values[self.rows, :, self.positions] = value[0].transpose(0, 1)
            return key, value
        rows = key.shape[0]  # key: [rows, heads, 1, dim]
        keys[self.rows, :, self.positions] = key[:, :, 0]
        values[self.rows, :, self.positions] = value[:, :, 0]
        return keys[:rows, :, : self.span], values[:rows, :, : self.span]

    def move(self, source: int, target: int, tokens: int) -> None:
        """Copy a sequence's first `tokens` positions from slot `source` to slot `target`."""
        self.keys[:, target, :, :tokens] = self.keys[:, source, :, :tokens]
        self.values[:, target, :, :tokens] = self.values[:, source, :, :tokens]
        self.valid[target] = max(self.valid[target], tokens)

    def cover(self, slot: int, span: int) -> None:
        """Make the first `span` positions of `slot` hold numbers (zeros where nothing was written)."""
        if self.valid[slot] < span:
            self.keys[:, slot, :, self.valid[slot]:span] = 0
            self.values[:, slot, :, self.valid[slot]:span] = 0
            self.valid[slot] = span

    # The parts of transformers' Cache interface a forward may ask for.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return False


@dataclass
class _Job:
    request: GenerationRequest | None
    call: Callable[[], Any] | None
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]


@dataclass
class _Row:
    """A running request: its slot is its index in `Scheduler.rows`."""

    job: _Job
    request: GenerationRequest
    result: Generation
    limit: int
    generator: torch.Generator
    pending: collections.deque[int]
    closing: bool
    stops: list[str]
    length: int = 0  # positions of its cache written
    last: int = 0  # the token to feed at the next step

    @property
    def prompt(self) -> tuple[int, ...]:
        return tuple(self.request.prompt_ids)


class Scheduler:
    """The one thread that touches the model: continuous batching of requests, calls run alone."""

    def __init__(self, engine: Engine, select: Callable[[str | None], None], *, max_batch: int, slot_tokens: int,
                 max_queue: int = 256, prefill_tokens: int = 512,
                 version: Callable[[], str | None] | None = None) -> None:
        self.engine = engine
        self.select = select
        # The base weights' model_version, read when a request joins: the weights change only in a call, which
        # runs once the batch has drained, so every token of a request comes from the weights it joined under.
        self.version = version or (lambda: None)
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_tokens = max(prefill_tokens, 1)
        self.cache = SlotCache(engine.model, max_batch, slot_tokens)
        self.rows: list[_Row] = []
        self.weights: str | None = None  # the adapter of the running batch
        self._jobs: collections.deque[_Job] = collections.deque()
        self._waiting = 0  # requests in _jobs (calls are not counted)
        self._ready = threading.Condition()
        self._closed = False
        self.waves = 0  # batches started from empty
        self.largest_wave = 0  # most requests decoded together
        self.steps = 0
        self.shared_prompts = 0  # requests whose prompt's K/V were copied from a row with the same prompt
        self._step_s = 0.05  # running mean of a decode step, for Retry-After
        self._sdpa = getattr(engine.model.config, "_attn_implementation", "sdpa") == "sdpa"
        self._thread = threading.Thread(target=self._worker, name="transformers-engine", daemon=True)
        self._thread.start()

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return self._waiting

    @property
    def running(self) -> bool:
        return bool(self.rows)

    async def submit(self, request: GenerationRequest) -> Generation:
        """Queue a generation (QueueFull when `max_queue` already wait) and await it."""
        try:
            return await self._put(request, None)
        except asyncio.CancelledError:
            request.cancel.set()  # a queued request is skipped, a running one leaves at its next token
            raise

    async def run(self, call: Callable[[], Any]) -> Any:
        """`call()` on the worker thread, alone, after every request queued before it."""
        return await self._put(None, call)

    async def _put(self, request: GenerationRequest | None, call: Callable[[], Any] | None) -> Any:
        if self._closed:
            raise RuntimeError("the generation queue is closed")
        loop = asyncio.get_running_loop()
        job = _Job(request, call, loop, loop.create_future())
        with self._ready:
            # Free slots take requests at once; beyond them, max_queue may wait.
            if request is not None and self.queued >= self.max_queue + self.max_batch - len(self.rows):
                raise QueueFull(self.queued, self.retry_after_s())
            self._jobs.append(job)
            self._waiting += request is not None
            self._ready.notify()
        return await job.future

    def retry_after_s(self) -> float:
        """About how long until a slot frees: the queue ahead, served max_batch at a time, at today's step time."""
        tokens = max((row.limit for row in self.rows), default=16)
        return max(1.0, (1 + self.queued // self.max_batch) * tokens * self._step_s)

    def close(self, timeout: float | None = None) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the worker

    def _worker(self) -> None:
        while True:
            with self._ready:
                while not self._jobs and not self.rows and not self._closed:
                    self._ready.wait()
                if self._closed and not self.rows and not self._jobs:
                    return
                call = self._jobs[0] if self._jobs and self._jobs[0].call is not None and not self.rows else None
                if call is not None:
                    self._jobs.popleft()
                joining = [] if call is not None else self._admit()
            if call is not None:
                with fp32_matmuls(FULL):  # a co-located trainer's step sets its own inside
                    _settle(call, _attempt(call.call))  # type: ignore[arg-type]
                continue
            with fp32_matmuls(FULL):  # fp32 weights serve in fp32, whatever a trainer in this process set
                outcome = _attempt(lambda: self._step(joining))
            if isinstance(outcome, BaseException):  # the model failed: every running request gets the error
                for row in self.rows:
                    _settle(row.job, outcome)
                self.rows = []

    def _admit(self) -> list[_Job]:
        """Under the lock: the waiting requests that join now (free slots, the batch's weights, the prefill budget),
        up to the first call in the queue."""
        if not self.rows:
            self.weights = next((job.request.adapter for job in self._jobs if job.request is not None), None)
        joining: list[_Job] = []
        tokens = 0
        free = self.max_batch - len(self.rows)
        prompts = {row.prompt for row in self.rows}  # a prompt already in the batch costs one token (shared)
        for job in list(self._jobs):
            if job.call is not None or len(joining) >= free:
                break
            request = job.request
            assert request is not None
            if request.cancel.is_set() or job.future.done():
                self._jobs.remove(job)
                self._waiting -= 1
                continue
            if request.adapter != self.weights:
                break  # first come, first served: the other weights start once this batch drains
            prompt = tuple(request.prompt_ids)
            cost = 1 if prompt in prompts else len(prompt)
            if joining and tokens + cost > self.prefill_tokens:
                break
            tokens += cost
            prompts.add(prompt)
            joining.append(job)
            self._jobs.remove(job)
            self._waiting -= 1
        return joining

    @torch.inference_mode()
    def _step(self, joining: list[_Job]) -> None:
        if joining:
            if not self.rows:
                self.waves += 1
                self.select(self.weights)
            self._prefill(joining)
        if self.rows:
            started = time.perf_counter()
            self._decode()
            self.steps += 1
            self._step_s = 0.9 * self._step_s + 0.1 * (time.perf_counter() - started)
        self.largest_wave = max(self.largest_wave, len(self.rows))

    def _prefill(self, joining: list[_Job]) -> None:
        """Write the joining prompts' K/V into their slots in one packed forward; sample each one's first token."""
        engine = self.engine
        fresh: list[_Row] = []
        for job in joining:
            request = job.request
            assert request is not None
            if len(request.prompt_ids) > self.cache.length - 1:
                _settle(job, ContextLengthError(len(request.prompt_ids), self.cache.length))
                continue
            limit = max(0, min(request.max_tokens, self.cache.length - len(request.prompt_ids)))
            if limit == 0:
                _settle(job, Generation([], [], [] if request.forced_ids else None, "length"))
                continue
            seed = request.seed if request.seed is not None else engine.new_seed()
            result = Generation([], [], [] if request.forced_ids else None, "length", version=self.version())
            fresh.append(_Row(job, request, result, limit,
                              torch.Generator().manual_seed(seed), collections.deque(request.forced_ids),
                              bool(request.closing_ids), [s for s in request.stop if s]))
        if not fresh:
            return
        # A prompt the batch holds already (a GRPO group's repeats, a retried request) is not computed again: its
        # K/V up to the last token are copied from that row's slot and the last token joins the next decode.
        first = len(self.rows)
        sources = {row.prompt: slot for slot, row in enumerate(self.rows)}
        packed: list[_Row] = []
        shared: list[_Row] = []
        for row in fresh:
            if row.prompt in sources and len(row.prompt) > 1:
                shared.append(row)
            else:  # computed in the packed forward, at slot first + its index there
                sources.setdefault(row.prompt, first + len(packed))
                packed.append(row)
        self.rows.extend(packed)
        logits = self._forward_packed(packed, first) if packed else None
        for row in shared:
            self.cache.move(sources[row.prompt], len(self.rows), len(row.prompt) - 1)
            row.length, row.last = len(row.request.prompt_ids) - 1, row.request.prompt_ids[-1]
            self.rows.append(row)
            self.shared_prompts += 1
        if logits is not None:
            self._sample(logits, packed, list(range(first, first + len(packed))))

    def _forward_packed(self, fresh: list[_Row], first: int) -> torch.Tensor:
        """The packed forward of the rows at slots first..: their K/V written, each one's last position's logits."""
        engine = self.engine
        slots = [first + i for i in range(len(fresh))]
        lengths = [len(row.request.prompt_ids) for row in fresh]
        device = engine.device
        ids = torch.tensor([t for row in fresh for t in row.request.prompt_ids], device=device)
        segment = torch.repeat_interleave(torch.arange(len(fresh)), torch.tensor(lengths))
        positions = torch.cat([torch.arange(n) for n in lengths])
        index = torch.arange(len(ids))
        allowed = (segment[:, None] == segment[None, :]) & (index[:, None] >= index[None, :])
        cache = self.cache
        cache.prefill, cache.rows, cache.positions = True, torch.tensor(slots).repeat_interleave(
            torch.tensor(lengths)).to(device), positions.to(device)
        ends = (torch.tensor(lengths).cumsum(0) - 1).to(device)
        try:
            out = engine.model(input_ids=ids[None], position_ids=positions[None].to(device),
                               attention_mask=self._mask(allowed[None, None].to(device)), use_cache=True,
                               logits_to_keep=ends, **{engine._cache_arg: cache})
        finally:
            cache.prefill = False
        for slot, row, n in zip(slots, fresh, lengths):
            row.length = n
            cache.valid[slot] = max(cache.valid[slot], n)
        return out.logits[0].float()

    def _decode(self) -> None:
        """One token for every running row, in one forward pass."""
        engine, cache, rows = self.engine, self.cache, self.rows
        device = engine.device
        lengths = torch.tensor([row.length for row in rows], device=device)
        cache.rows = torch.arange(len(rows), device=device)
        cache.positions = lengths
        cache.span = max(row.length for row in rows) + 1
        for slot in range(len(rows)):
            cache.cover(slot, cache.span)
        allowed = torch.arange(cache.span, device=device)[None, :] <= lengths[:, None]
        ids = torch.tensor([[row.last] for row in rows], device=device)
        out = engine.model(input_ids=ids, position_ids=lengths[:, None], attention_mask=self._mask(allowed[:, None, None]),
                           use_cache=True, **{engine._cache_arg: cache})
        for row in rows:
            row.length += 1
        self._sample(out.logits[:, -1].float(), list(rows), list(range(len(rows))))

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """SDPA takes the boolean mask; eager attention adds it."""
        if self._sdpa:
            return allowed
        dtype = next(self.engine.model.parameters()).dtype
        return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(dtype).min)

    def _sample(self, logits: torch.Tensor, rows: list[_Row], slots: list[int]) -> None:
        """Pick each row's next token (one copy to the host), record it, and retire the rows that ended."""
        tokens, logprobs, forced = self.engine.pick(logits, [row.request for row in rows],
                                                    [row.generator for row in rows], [row.pending for row in rows])
        picked = torch.stack([tokens.double(), logprobs.double()]).tolist()  # the step's one host sync
        ended: list[int] = []
        for i, (row, slot) in enumerate(zip(rows, slots)):
            if self._record(row, int(picked[0][i]), picked[1][i], bool(forced[i])):
                ended.append(slot)
        for slot in sorted(ended, reverse=True):
            self._retire(slot)

    def _record(self, row: _Row, token: int, logprob: float, forced: bool) -> bool:
        """Append one token to a row's result; True when the row ends with it."""
        engine, result, request = self.engine, row.result, row.request
        if not result.token_ids:
            result.first_token_at = time.perf_counter()
        result.token_ids.append(token)
        result.logprobs.append(logprob)
        row.last = token
        if result.forced is not None:
            result.forced.append(int(forced))
        if row.closing and not forced and call_closed(engine.detokenize(result.token_ids)):
            row.closing = False
            row.pending.extend(request.closing_ids)
        if token in engine.eog_ids:
            result.finish_reason = "stop"
        elif row.stops and engine.stopped(result, row.stops):
            result.finish_reason = "stop"
        elif len(result.token_ids) >= row.limit:
            result.finish_reason = "length"
        elif request.cancel.is_set():
            result.finish_reason = "abort"
        else:
            return False
        return True

    def _retire(self, slot: int) -> None:
        """Deliver a finished row and give its slot to the last row."""
        row = self.rows[slot]
        _settle(row.job, row.result)
        last = len(self.rows) - 1
        if slot != last:
            moved = self.rows[last]
            self.cache.move(last, slot, moved.length)
            self.rows[slot] = moved
        self.rows.pop()


def _attempt(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as error:  # delivered to the awaiting request(s)
        return error


def _settle(job: _Job, outcome: Any) -> None:
    deliver(job.loop, job.future, outcome)
