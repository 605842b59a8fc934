"""A fair FIFO queue in front of the engine: worker threads take jobs in arrival order.

The engine is synchronous and CPU-bound (one generation keeps the cores busy), so it runs in its own
thread(s) and the event loop only waits on results. A job talks back to the event loop through an
asyncio.Queue (call_soon_threadsafe); the loop side cancels a job by setting its cancel reason, which
the work function checks between verification steps. A job that is still waiting can be withdrawn
(client gone, timeout) so its place in the queue is freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)


class QueueFull(Exception):
    """More requests are waiting than the server allows."""


class Job:
    """One unit of work for an engine thread, with its channel back to the event loop.

    work(job) runs in the worker thread; it reports through job.emit(kind, payload) and should call
    job.stop_reason() between steps and stop when it returns a reason ("disconnect" or "timeout").
    """

    def __init__(self, work: Callable[["Job"], None], loop: asyncio.AbstractEventLoop, timeout: float):
        self.work = work
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.submitted = time.monotonic()
        self.deadline = self.submitted + timeout
        self.timeout = timeout
        self.started: float | None = None
        self._cancel: str | None = None

    def cancel(self, reason: str) -> None:
        if self._cancel is None:
            self._cancel = reason

    def stop_reason(self) -> str | None:
        if self._cancel is not None:
            return self._cancel
        if time.monotonic() > self.deadline:
            return "timeout"
        return None

    @property
    def queue_time(self) -> float:
        return (self.started or time.monotonic()) - self.submitted

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            pass


class Scheduler:
    """Runs jobs in arrival order on `workers` threads, with at most `max_queue` jobs waiting."""

    def __init__(self, max_queue: int = 16, workers: int = 1, metrics=None):
        if max_queue < 0 or workers < 1:
            raise ValueError("max_queue must be >= 0 and workers >= 1")
        self.max_queue, self.metrics = max_queue, metrics
        self._waiting: deque[Job] = deque()
        self._running = 0
        self._closed = False
        self._cv = threading.Condition()
        self._threads = [threading.Thread(target=self._loop, name=f"verispec-engine-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self._waiting), self._running)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise QueueFull("the server is shutting down")
            # jobs a free worker is about to take do not count as waiting, however the threads are timed
            if len(self._waiting) + self._running - len(self._threads) >= self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting (the limit is {self.max_queue})")
            self._waiting.append(job)
            self._publish()
            self._cv.notify()

    def withdraw(self, job: Job) -> bool:
        """Remove a job that has not started yet; False when it is running or done."""
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:
                return False
            self._publish()
            return True

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._waiting.popleft()
                self._running += 1
                self._publish()
            job.started = time.monotonic()
            if self.metrics is not None:
                self.metrics.waited(job.queue_time)
            try:
                reason = job.stop_reason()
                if reason is not None:
                    if self.metrics is not None:
                        self.metrics.cancel(reason)
                    job.emit("cancelled", reason)
                else:
                    job.work(job)
            except Exception as exc:  # reported to the request; the worker keeps serving
                if not getattr(exc, "expected", False):  # a bad request is not worth a traceback in the log
                    log.exception("generation failed")
                job.emit("error", exc)
            finally:
                with self._cv:
                    self._running -= 1
                    self._publish()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._waiting)
            self._waiting.clear()
            self._cv.notify_all()
        for job in pending:
            job.emit("cancelled", "shutdown")
