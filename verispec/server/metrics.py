"""Server metrics in the Prometheus text exposition format (version 0.0.4), without a client library.

A handful of counters, gauges and histograms is all the server needs; keeping them here (thread-safe,
updated from the worker thread and the event loop) avoids a dependency and keeps the names in one place.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34)).replace(chr(10), " ")}"'
                     for k, v in labels)
    return "{" + inner + "}"


def _num(v: float) -> str:
    f = float(v)
    if math.isinf(f):
        return "+Inf" if f > 0 else "-Inf"
    return str(int(f)) if f.is_integer() and abs(f) < 1e15 else repr(f)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1
        self.sum += v
        self.count += 1


class ServerMetrics:
    """All metrics of one server. Methods are called from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple, int] = defaultdict(int)          # (endpoint, status)
        self.cancelled: dict[str, int] = defaultdict(int)           # reason
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.committed_tokens = 0    # tokens committed by the steps of finished generations
        self.finished_steps = 0      # ... and those steps (tau = committed / finished_steps)
        self.steps = 0
        self.drafted = 0
        self.accepted = 0
        self.generations: dict[str, int] = defaultdict(int)         # method
        self.drafted_by_position: list[int] = []
        self.accepted_by_position: list[int] = []
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.latency = _Histogram(LATENCY_BUCKETS)
        self.queue_wait = _Histogram(LATENCY_BUCKETS)
        self.queued = 0
        self.running = 0
        self.batch_active = 0        # sequences in the engine threads' batches now
        self.batch_steps = 0         # batch steps (one shared target forward each, per engine thread)
        self.batch_sequence_steps = 0  # ... and the sequences they advanced (mean batch size = ratio)
        self.max_batch = 1
        self.batch_positions: int | None = None
        self.runners = lambda: 0   # set by the app: runners built so far (they are pooled and reused)

    # --- updates -------------------------------------------------------------------------------
    def request_done(self, endpoint: str, status: int, latency: float | None = None) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1
            if latency is not None and status < 400:
                self.latency.observe(latency)

    def step(self, n_tokens: int) -> None:
        """One verification step of any generation (counted live, so a cancelled one stops counting)."""
        with self._lock:
            self.steps += 1
            self.generated_tokens += n_tokens

    def generation_done(self, stats, cancelled: str | None = None) -> None:
        """Fold in a finished (or cancelled) generation's SpecStats; tokens and steps were counted live."""
        with self._lock:
            self.generations[stats.method] += 1
            self.prompt_tokens += stats.prompt_tokens
            self.drafted += stats.drafted
            self.accepted += stats.accepted
            self.committed_tokens += stats.committed
            self.finished_steps += stats.steps
            while len(self.drafted_by_position) < len(stats.drafted_by_position):
                self.drafted_by_position.append(0)
                self.accepted_by_position.append(0)
            for i, (d, a) in enumerate(zip(stats.drafted_by_position, stats.accepted_by_position)):
                self.drafted_by_position[i] += d
                self.accepted_by_position[i] += a
            if stats.first_token_time is not None:
                self.ttft.observe(stats.first_token_time)
            if cancelled:
                self.cancelled[cancelled] += 1

    def cancel(self, reason: str) -> None:
        """A generation cancelled before it produced any statistics (still queued)."""
        with self._lock:
            self.cancelled[reason] += 1

    def waited(self, seconds: float) -> None:
        with self._lock:
            self.queue_wait.observe(seconds)

    def set_queue(self, queued: int, running: int) -> None:
        with self._lock:
            self.queued, self.running = queued, running

    def set_batch(self, active: int) -> None:
        with self._lock:
            self.batch_active = active

    def set_batch_limits(self, max_batch: int, positions: int | None) -> None:
        with self._lock:
            self.max_batch, self.batch_positions = max_batch, positions

    def batch_step(self, sequences: int) -> None:
        """One batch step that advanced `sequences` generations together."""
        with self._lock:
            self.batch_steps += 1
            self.batch_sequence_steps += sequences

    # --- exposition ----------------------------------------------------------------------------
    def render(self) -> str:
        with self._lock:
            lines: list[str] = []

            def metric(name: str, kind: str, help_: str, samples):
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} {kind}")
                for labels, value in samples:
                    lines.append(f"{name}{_labels(labels)} {_num(value)}")

            def histogram(name: str, help_: str, h: _Histogram):
                lines.append(f"# HELP {name} {help_}")
                lines.append(f"# TYPE {name} histogram")
                for b, c in zip(h.buckets, h.counts):
                    lines.append(f'{name}_bucket{{le="{_num(b)}"}} {c}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {h.count}')
                lines.append(f"{name}_sum {_num(h.sum)}")
                lines.append(f"{name}_count {h.count}")

            metric("verispec_requests_total", "counter", "HTTP API requests by endpoint and status code.",
                   [((("endpoint", e), ("status", s)), v) for (e, s), v in sorted(self.requests.items())])
            metric("verispec_generations_total", "counter", "Generations run, by speculation method.",
                   [((("method", m),), v) for m, v in sorted(self.generations.items())])
            metric("verispec_generations_cancelled_total", "counter",
                   "Generations stopped early: client disconnect or timeout.",
                   [((("reason", r),), v) for r, v in sorted(self.cancelled.items())])
            metric("verispec_prompt_tokens_total", "counter", "Prompt tokens processed.", [((), self.prompt_tokens)])
            metric("verispec_generated_tokens_total", "counter", "Tokens generated and sent to clients.",
                   [((), self.generated_tokens)])
            metric("verispec_verification_steps_total", "counter", "Target model forward passes in decode loops.",
                   [((), self.steps)])
            metric("verispec_drafted_tokens_total", "counter", "Draft tokens proposed to the target.", [((), self.drafted)])
            metric("verispec_accepted_tokens_total", "counter", "Draft tokens the target accepted.", [((), self.accepted)])
            metric("verispec_acceptance_rate", "gauge", "Accepted / drafted tokens over all finished generations.",
                   [((), self.accepted / self.drafted if self.drafted else 0.0)])
            metric("verispec_mean_accepted_length", "gauge",
                   "Tokens committed per target forward (bonus included) over all finished generations.",
                   [((), self.committed_tokens / self.finished_steps if self.finished_steps else 0.0)])
            metric("verispec_acceptance_by_position", "gauge",
                   "Fraction of steps reaching draft position i where the token there was accepted.",
                   [((("position", str(i)),), a / d if d else 0.0)
                    for i, (a, d) in enumerate(zip(self.accepted_by_position, self.drafted_by_position))])
            metric("verispec_queue_length", "gauge", "Requests waiting for the engine.", [((), self.queued)])
            metric("verispec_running", "gauge", "Generations running now.", [((), self.running)])
            metric("verispec_batch_active_sequences", "gauge", "Generations in the engine's batch now.",
                   [((), self.batch_active)])
            metric("verispec_batch_max_sequences", "gauge", "Most generations one engine thread batches (--max-batch).",
                   [((), self.max_batch)])
            metric("verispec_batch_positions", "gauge",
                   "Verified positions a batch step may spend across its sequences (0: no budget).",
                   [((), self.batch_positions or 0)])
            metric("verispec_batch_steps_total", "counter", "Batch steps: one shared target forward for all its sequences.",
                   [((), self.batch_steps)])
            metric("verispec_batch_sequence_steps_total", "counter",
                   "Sequences advanced by batch steps (divided by the steps: the mean batch size).",
                   [((), self.batch_sequence_steps)])
            metric("verispec_runners_built_total", "counter",
                   "Model runners (fused weights + KV cache) built; requests reuse idle ones.", [((), self.runners())])
            histogram("verispec_time_to_first_token_seconds", "Time from generation start to the first token.", self.ttft)
            histogram("verispec_request_latency_seconds", "Time from request arrival to the last byte (successful requests).",
                      self.latency)
            histogram("verispec_queue_wait_seconds", "Time a request waited for the engine.", self.queue_wait)
            return "\n".join(lines) + "\n"
