"""The one thread allowed to touch the embedded model, and the FIFO queue of requests in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollgym.local_model import deliver

from .engine import GenerationResult, LlamaEngine

__all__ = ["GenerationQueue"]


@dataclass
class _Job:
    """One queued request: engine kwargs, its cancel flag and where to deliver the result."""

    kwargs: dict[str, Any]
    cancel: threading.Event
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    call: Callable[[], Any] | None = None


class GenerationQueue:
    """Serialises requests onto ONE worker thread that owns a :class:`LlamaEngine`.

    FIFO fairness: requests run one at a time in submission order. ``submit`` is
    awaitable from asyncio and never blocks the event loop. Cancelling the awaiting
    task (client disconnect) sets the request's cancel event: a queued request is
    skipped, a running one stops at the next token, so the worker moves on.
    ``on_result(kwargs, result_or_exception)`` is called on the worker thread after
    each executed request (metrics / logging), including aborted ones.
    """

    def __init__(
        self,
        engine: LlamaEngine,
        on_result: Callable[[dict[str, Any], GenerationResult | BaseException], None] | None = None,
    ) -> None:
        """In: the engine (the queue's thread becomes its only user) and an optional hook."""
        self.engine = engine
        self._on_result = on_result
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._running = False
        self._thread = threading.Thread(target=self._worker, name="llama-engine", daemon=True)
        self._thread.start()

    async def submit(self, **kwargs: Any) -> GenerationResult:
        """Queue ``engine.generate(**kwargs)`` and await its :class:`GenerationResult`.

        Exceptions from the engine (ContextLengthError, ValueError) are re-raised here.
        """
        if self._closed:
            raise RuntimeError("GenerationQueue is closed")
        loop = asyncio.get_running_loop()
        job = _Job(kwargs=kwargs, cancel=threading.Event(), loop=loop, future=loop.create_future())
        self._jobs.put(job)
        try:
            return await job.future
        except asyncio.CancelledError:
            job.cancel.set()  # checked by the worker before starting and between tokens
            raise

    async def run(self, call: Callable[[], Any]) -> Any:
        """Run `call()` on the worker thread after every request queued before it (FIFO); its result."""
        if self._closed:
            raise RuntimeError("GenerationQueue is closed")
        loop = asyncio.get_running_loop()
        job = _Job(kwargs={}, cancel=threading.Event(), loop=loop, future=loop.create_future(), call=call)
        self._jobs.put(job)
        return await job.future

    @property
    def running(self) -> bool:
        """Whether the worker is generating right now."""
        return self._running

    @property
    def queued(self) -> int:
        """Requests waiting behind the running one (approximate; includes cancelled ones)."""
        return self._jobs.qsize()

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting requests, let queued ones finish, and join the worker thread."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout)

    def _worker(self) -> None:
        """Worker thread: run jobs in FIFO order until the None sentinel."""
        while (job := self._jobs.get()) is not None:
            if job.cancel.is_set() or job.future.done():
                continue  # cancelled while waiting: give the slot to the next request
            outcome: GenerationResult | BaseException
            self._running = True
            try:
                if job.call is not None:
                    outcome = job.call()
                else:
                    outcome = self.engine.generate(**job.kwargs, cancel_event=job.cancel)
            except Exception as error:  # delivered to the awaiting task
                outcome = error
            finally:
                self._running = False
            if self._on_result is not None and job.call is None:
                # A broken hook must not kill the only worker thread.
                with contextlib.suppress(Exception):
                    self._on_result(job.kwargs, outcome)
            deliver(job.loop, job.future, outcome)
