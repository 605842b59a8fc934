"""A fair FIFO queue in front of the engine, whose thread runs a continuous batch.

The engine is synchronous and CPU-bound, so it runs in its own thread(s) and the event loop only
waits on results. Each engine thread owns a `verispec.batch.Batch` and loops: admit waiting jobs in
arrival order while the batch has room, advance every admitted generation by one verification step
with one shared target forward, report each step to its job, let finished and cancelled generations
leave. A request therefore joins the running batch between two steps instead of waiting for the
others to finish, and leaves it alone: a gone client or a passed deadline stops only its own
sequence (Batch.step asks each sequence's should_stop before the step). With max_batch 1 the same
loop serves one generation at a time.

Two kinds of job:
  - a `Member` (work.BatchedGeneration): a generation that joins the batch;
  - a plain callable work(job): run whole, alone, between two batch steps (the race endpoint, whose
    lanes time themselves and would be disturbed by sharing forwards). The batch's sequences wait
    meanwhile; a race is short (max_tokens is capped) and their deadlines keep running.

A job talks back to the event loop through an asyncio.Queue (call_soon_threadsafe); the loop side
cancels a job by setting its cancel reason, which the engine thread checks before each step and
between a prompt's prefill chunks. A job that is still waiting can be withdrawn (client gone,
timeout) so its place in the queue is freed at once.
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


class Member:
    """A generation that runs inside the engine thread's batch. The scheduler calls, in its thread:
    join(job, batch) once (build the engine, Batch.add: prefill; returns the Decoding), step(job,
    event) per verification step, leave(job, run) when it finished or was cancelled, and abort(job)
    when it ends with an error instead (its resources go back)."""

    def join(self, job: "Job", batch):  # -> verispec.engine.Decoding
        raise NotImplementedError

    def step(self, job: "Job", event) -> None:
        raise NotImplementedError

    def leave(self, job: "Job", run) -> None:
        raise NotImplementedError

    def abort(self, job: "Job") -> None:
        raise NotImplementedError


class Job:
    """One request for an engine thread, with its channel back to the event loop.

    work: a Member (joins the batch) or a callable work(job) run alone between batch steps, which
    reports through job.emit(kind, payload) and should call job.stop_reason() between its steps and
    stop when it returns a reason ("disconnect", "timeout" or "shutdown").
    """

    def __init__(self, work: "Member | Callable[[Job], None]", loop: asyncio.AbstractEventLoop, timeout: float):
        self.work = work
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.submitted = time.monotonic()
        self.deadline = self.submitted + timeout
        self.timeout = timeout
        self.started: float | None = None
        self._cancel: str | None = None

    @property
    def batched(self) -> bool:
        return isinstance(self.work, Member)

    def cancel(self, reason: str) -> None:
        if self._cancel is None:
            self._cancel = reason

    def stop_reason(self) -> str | None:
        if self._cancel is not None:
            return self._cancel
        if time.monotonic() > self.deadline:
            return "timeout"
        return None

    def should_stop(self) -> bool:
        return self.stop_reason() is not None

    @property
    def queue_time(self) -> float:
        return (self.started or time.monotonic()) - self.submitted

    def emit(self, kind: str, payload: Any = None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, payload))
        except RuntimeError:  # the event loop is gone (server shutting down): nobody is listening
            pass


class Scheduler:
    """Runs jobs in arrival order on `workers` engine threads, each a batch of at most `max_batch`
    generations, with at most `max_queue` jobs waiting beyond the free places.

    positions: the per-step budget of verified positions across a batch: an int (Batch's `positions`),
    None (no budget), a cost curve (Batch's `cost`: the budget follows the batch's size), or a callable
    returning one of those, asked once in the first engine thread as it starts (the server measures its
    cost curve there, off the event loop, before a request waits for it).
    """

    def __init__(self, max_queue: int = 16, workers: int = 1, metrics=None, max_batch: int = 1,
                 positions: "int | dict | None | Callable[[], int | dict | None]" = None):
        if max_queue < 0 or workers < 1 or max_batch < 1:
            raise ValueError("max_queue must be >= 0, workers >= 1 and max_batch >= 1")
        self.max_queue, self.metrics, self.max_batch = max_queue, metrics, max_batch
        self._positions = positions
        self._positions_known = not callable(positions)
        self._waiting: deque[Job] = deque()
        self._running = 0                    # jobs taken by an engine thread and not finished
        self._sizes = [0] * workers          # sequences in each thread's batch
        self._closed = False
        self._cv = threading.Condition()
        self._positions_lock = threading.Lock()
        if metrics is not None:
            metrics.set_batch_limits(max_batch, None if callable(positions) else self._full_budget(positions))
        self._threads = [threading.Thread(target=self._loop, args=(i,), name=f"verispec-engine-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def capacity(self) -> int:
        """Jobs the engine threads hold at once."""
        return len(self._threads) * self.max_batch

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self._waiting), self._running)
            self.metrics.set_batch(sum(self._sizes))

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closed:
                raise QueueFull("the server is shutting down")
            # jobs a free place is about to take do not count as waiting, however the threads are timed
            if len(self._waiting) + self._running - self.capacity >= self.max_queue:
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

    def _full_budget(self, positions) -> int | None:
        """The positions budget of a full batch (a cost curve's at max_batch sequences), for /metrics."""
        from verispec.batch import free_positions

        return free_positions(positions, rows=self.max_batch) if isinstance(positions, dict) else positions

    def positions(self) -> int | dict | None:
        """The per-step positions budget (or cost curve), resolved on first use (in an engine thread)."""
        if not self._positions_known:
            with self._positions_lock:
                if not self._positions_known:
                    self._positions = self._positions()
                    self._positions_known = True
                    if self.metrics is not None:
                        self.metrics.set_batch_limits(self.max_batch, self._full_budget(self._positions))
        return self._positions

    def _new_batch(self):
        from verispec.batch import Batch

        budget = self.positions()
        if isinstance(budget, dict):
            return Batch(self.max_batch, cost=budget)
        return Batch(self.max_batch, budget)

    # --- the engine thread ------------------------------------------------------------------
    def _loop(self, index: int) -> None:
        if index == 0 and not self._positions_known:
            # measure the positions budget now, while no request waits for it
            try:
                self.positions()
            except Exception:
                log.exception("measuring the batch's positions budget failed; it is tried again at the first request")
        batch = None
        members: dict[int, tuple[Job, Member]] = {}   # id(Decoding) -> its job
        while True:
            with self._cv:
                while not self._waiting and not members and not self._closed:
                    self._cv.wait()
                if self._closed:
                    break
                # admit in arrival order while there is room; a plain job is taken alone, then the batch steps
                admit: list[Job] = []
                while self._waiting and len(members) + len(admit) < self.max_batch:
                    job = self._waiting.popleft()
                    admit.append(job)
                    if not job.batched:
                        break
                self._running += len(admit)
                self._publish()
            for job in admit:
                if batch is None:
                    batch = self._guard(admit, self._new_batch)
                    if batch is None:
                        break
                self._start(job, batch, members)
            self._size(index, len(members))
            if members:
                batch = self._step(batch, members)
                self._size(index, len(members))
        for run in list(batch.active) if batch is not None else []:  # shutting down: the batch ends here
            job, member = members.pop(id(run))
            job.cancel("shutdown")
            batch.cancel(run)
            self._end(job, lambda: member.leave(job, run))

    def _guard(self, admit: list[Job], make):
        """make(), or None after reporting its error to the admitted jobs."""
        try:
            return make()
        except Exception as exc:  # the positions budget could not be measured: nothing can run
            log.exception("the batch could not be set up")
            for job in admit:
                self._end(job, lambda job=job, exc=exc: job.emit("error", exc))
            return None

    def _size(self, index: int, n: int) -> None:
        with self._cv:
            if self._sizes[index] != n:
                self._sizes[index] = n
                self._publish()

    def _done(self) -> None:
        with self._cv:
            self._running -= 1
            self._publish()

    def _end(self, job: Job, report: Callable[[], None]) -> None:
        """A job leaves the engine thread: its last report, then its place is free."""
        try:
            report()
        except Exception:  # a report failing must not take the engine thread down
            log.exception("reporting a finished generation failed")
        finally:
            self._done()

    def _start(self, job: Job, batch, members: dict) -> None:
        job.started = time.monotonic()
        if self.metrics is not None:
            self.metrics.waited(job.queue_time)
        reason = job.stop_reason()
        if reason is not None:
            if self.metrics is not None:
                self.metrics.cancel(reason)
            self._end(job, lambda: job.emit("cancelled", reason))
            return
        member = job.work if job.batched else None
        try:
            if member is None:
                job.work(job)
                self._done()
                return
            run = member.join(job, batch)   # the prompt is prefilled now
        except Exception as exc:  # reported to the request; the thread keeps serving
            if not getattr(exc, "expected", False):  # a bad request is not worth a traceback in the log
                log.exception("generation failed")

            def report(exc=exc):
                if member is not None:
                    member.abort(job)
                job.emit("error", exc)
            self._end(job, report)
            return
        if run in batch.active:
            members[id(run)] = (job, member)
        else:  # stopped during its prefill
            self._end(job, lambda: member.leave(job, run))

    def _step(self, batch, members: dict):
        """One step of every sequence in the batch -> the batch to go on with."""
        try:
            report = batch.step()
        except Exception as exc:
            # a shared forward (or a drafter inside the step) failed; its sequences cannot be told
            # apart, so each ends with the error and a fresh batch goes on with the next jobs
            log.exception("a batch step failed")
            for job, member in list(members.values()):
                self._end(job, lambda job=job, member=member, exc=exc: (member.abort(job), job.emit("error", exc)))
            members.clear()
            return None
        if self.metrics is not None:
            self.metrics.batch_step(sum(event is not None for _, event in report))
        for run, event in report:
            job, member = members[id(run)]
            if event is not None:
                try:
                    member.step(job, event)
                except Exception:
                    log.exception("reporting a step failed")
            if run.finished:
                del members[id(run)]
                self._end(job, lambda: member.leave(job, run))
        return batch

    def close(self) -> None:
        with self._cv:
            self._closed = True
            pending = list(self._waiting)
            self._waiting.clear()
            self._cv.notify_all()
        for job in pending:
            job.emit("cancelled", "shutdown")
