"""Dynamic batching: the completions of concurrent requests are scored together.

Each request is first prepared on arrival (checked, rendered by the chat template and tokenised: ``prepare_fn``, in a
thread of its own, so this work overlaps the model's work on earlier requests; the requests that arrived together in
one call, and where that call refuses, each alone, so a request the model refuses fails alone), then waits in one
queue. A single worker takes what is waiting, waits at most ``max_wait_s`` after the first
arrival for more to join (never longer than it takes the batch to fill), and scores up to ``max_batch`` completions
in one call of the model (``score_fn``, in a worker thread, so the event loop goes on accepting requests meanwhile);
each request gets back exactly the rows of its own completions, in its order. 32 clients sending 8 completions each
thus cost one forward pass of 256 rows rather than 32 of 8. A request larger than ``max_batch`` is scored in slices
of it.

The queue is bounded in completions (``max_queue``, those being prepared included): a request that would grow it
beyond is refused at once (:class:`QueueFull`, HTTP 503), so memory does not grow with the load.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More completions are waiting than ``max_queue`` allows."""


@dataclass
class Rows:
    """Prepared rows as they came (the default preparation): what ``score_fn`` receives where nothing is prepared."""

    prompts: list
    completions: list

    def __len__(self) -> int:
        return len(self.prompts)

    def rows(self, start: int, stop: int) -> Rows:
        return Rows(self.prompts[start:stop], self.completions[start:stop])


@dataclass
class _Job:
    prepared: Any                                     # sized, with .rows(start, stop)
    future: asyncio.Future
    done: int = 0                                     # completions of this job already scored
    parts: list = field(default_factory=list)        # their (reward, u) slices, in order

    @property
    def left(self) -> int:
        return len(self.prepared) - self.done


class ScoreBatcher:
    """``await batcher.score(prompts, completions)`` -> (reward, u) arrays of that request: prepared by
    ``prepare_fn(prompts, completions)`` (a sized object with ``.rows(start, stop)``; default :class:`Rows`) and
    scored in shared batches by ``score_fn([prepared rows, ...]) -> (reward, u)`` of their rows in order (one worker
    thread, one call at a time)."""

    def __init__(self, score_fn, max_batch: int, max_wait_s: float, max_queue: int, prepare_fn=Rows):
        self.score_fn, self.prepare_fn = score_fn, prepare_fn
        self.max_batch, self.max_wait_s, self.max_queue = max_batch, max_wait_s, max_queue
        self._jobs: deque[_Job] = deque()
        self._queued = 0          # completions admitted (being prepared or waiting): what max_queue bounds
        self._ready = 0           # of them, prepared and waiting for the model
        self._arrivals: deque[tuple[list, list, asyncio.Future]] = deque()   # waiting to be prepared
        self._wake: asyncio.Event | None = None      # set when a prepared request joins the queue
        self._arrived: asyncio.Event | None = None   # set when a request arrives to be prepared
        self._worker: asyncio.Task | None = None
        self._preparer: asyncio.Task | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="score")
        self._prepare = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")
        self.batches = 0          # model calls made (for /info and the load test)
        self.received = 0         # completions accepted into the queue
        self.scored = 0           # completions scored
        self.busy_s = 0.0         # seconds spent in the model (the rest of the wall time it waited for requests)

    @property
    def queued(self) -> int:
        return self._queued

    def start(self) -> None:
        self._wake, self._arrived = asyncio.Event(), asyncio.Event()
        loop = asyncio.get_running_loop()
        self._worker = loop.create_task(self._run())
        self._preparer = loop.create_task(self._prepare_arrivals())

    async def stop(self) -> None:
        """After the server stopped taking requests: let the queued ones finish, then end the worker."""
        while self._queued or self._jobs:
            await asyncio.sleep(0.01)
        for task in (self._worker, self._preparer):
            if task is not None:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        self._thread.shutdown(wait=True)
        self._prepare.shutdown(wait=True)

    async def score(self, prompts: list, completions: list) -> tuple[np.ndarray, np.ndarray]:
        n = len(prompts)
        if n == 0:
            return np.empty(0), np.empty(0)
        if self._queued + n > self.max_queue:
            raise QueueFull(f"{self._queued} completions are waiting to be scored (serve.max_queue={self.max_queue}); "
                            "retry later")
        self._queued += n
        loop = asyncio.get_running_loop()
        arrival = (prompts, completions, loop.create_future())
        self._arrivals.append(arrival)
        self._arrived.set()
        try:
            prepared = await arrival[2]
        except BaseException:   # refused (a text the model cannot take) or the caller gave up: only this request
            self._queued -= n
            self._wake.set()   # a batch waiting for it goes on
            raise
        job = _Job(prepared, loop.create_future())
        self._jobs.append(job)
        self._ready += n
        self.received += n
        self._wake.set()
        try:
            return await job.future
        except asyncio.CancelledError:   # the caller gave up (timeout, closed connection): not scored if not begun
            if job in self._jobs and job.done == 0:
                self._jobs.remove(job)
                self._queued -= n
                self._ready -= n
            raise

    async def _prepare_arrivals(self) -> None:
        """Prepare what has arrived, all of it together, while the model works on earlier batches."""
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while self._arrivals:
                arrivals = [a for a in self._arrivals if not a[2].done()]   # not those whose caller gave up
                self._arrivals.clear()
                results = await loop.run_in_executor(self._prepare, self._prepare_together,
                                                     [(prompts, completions) for prompts, completions, _ in arrivals])
                for (_, _, future), result in zip(arrivals, results):
                    if future.done():
                        continue
                    if isinstance(result, Exception):
                        future.set_exception(result)
                    else:
                        future.set_result(result)

    def _prepare_together(self, requests: list[tuple[list, list]]) -> list:
        """Each request prepared (or the exception refusing it): one call of ``prepare_fn`` for all of them (one
        rendering and tokenizer pass, not one per request); where that refuses, each request alone, so that a
        refusal stays with the request that caused it."""
        if len(requests) > 1:
            try:
                whole = self.prepare_fn([p for prompts, _ in requests for p in prompts],
                                        [c for _, completions in requests for c in completions])
            except Exception:   # noqa: BLE001 (found out below, request by request)
                pass
            else:
                starts = np.cumsum([0] + [len(prompts) for prompts, _ in requests])
                return [whole.rows(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]
        results = []
        for prompts, completions in requests:
            try:
                results.append(self.prepare_fn(prompts, completions))
            except Exception as err:   # noqa: BLE001 (this request's answer)
                results.append(err)
        return results

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._jobs:
                await self._fill()
                batch = self._take()
                parts = [job.prepared.rows(start, stop) for job, start, stop in batch]
                started = time.perf_counter()
                try:
                    reward, u = await loop.run_in_executor(self._thread, self.score_fn, parts)
                except Exception as err:   # noqa: BLE001 (every caller of the batch gets it; the worker goes on)
                    self._fail(batch, err)
                    continue
                self.batches += 1
                self.scored += sum(stop - start for _, start, stop in batch)
                self.busy_s += time.perf_counter() - started
                self._deliver(batch, np.asarray(reward, dtype=float), np.asarray(u, dtype=float))

    async def _fill(self) -> None:
        """Let concurrent requests join the batch: until it is full or ``max_wait_s`` has passed, whichever comes
        first (a full batch does not wait out the bound: the model would idle meanwhile), and past the bound for the
        requests already received and being prepared (they are moments away; a batch without them would leave them
        for the next one, half full)."""
        deadline = time.perf_counter() + self.max_wait_s
        while self._ready < self.max_batch:
            left = deadline - time.perf_counter()
            if left <= 0 and self._queued == self._ready:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left if left > 0 else None)
            except TimeoutError:
                pass

    def _take(self) -> list[tuple[_Job, int, int]]:
        """Up to ``max_batch`` completions from the front of the queue: (job, first, stop) slices, a job's rest left
        at the front for the next batch."""
        batch, room = [], self.max_batch
        while self._jobs and room > 0:
            job = self._jobs[0]
            take = min(room, job.left)
            batch.append((job, job.done, job.done + take))
            job.done += take
            room -= take
            self._queued -= take
            self._ready -= take
            if job.left == 0:
                self._jobs.popleft()
        return batch

    def _deliver(self, batch, reward: np.ndarray, u: np.ndarray) -> None:
        offset = 0
        for job, start, stop in batch:
            n = stop - start
            job.parts.append((reward[offset:offset + n], u[offset:offset + n]))
            offset += n
            if stop == len(job.prepared) and not job.future.done():
                job.future.set_result((np.concatenate([p[0] for p in job.parts]),
                                       np.concatenate([p[1] for p in job.parts])))

    def _fail(self, batch, err: Exception) -> None:
        for job, _, _ in batch:
            if job in self._jobs:   # the rest of a sliced job is not scored either
                self._jobs.remove(job)
                self._queued -= job.left
                self._ready -= job.left
            if not job.future.done():
                job.future.set_exception(err)
