"""Unit tests of the server's parts without HTTP: per-token pieces, the FIFO scheduler, the runner pool,
and the Prometheus exposition."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pytest

from verispec.metrics import SpecStats
from verispec.server.metrics import ServerMetrics
from verispec.server.scheduler import Job, QueueFull, Scheduler
from verispec.server.work import PieceDecoder, RunnerPool


def byte_decode(ids):
    return bytes(ids).decode("utf-8", errors="replace")


def test_pieces_join_to_the_text_and_hold_split_characters():
    text = "naïve café ☕ ok"
    ids = list(text.encode())
    dec = PieceDecoder(byte_decode)
    pieces = dec.add(ids[:5]) + dec.add(ids[5:9]) + dec.add(ids[9:])
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
    i = text.encode().index("☕".encode())
    assert pieces[i:i + 3] == ["", "", "☕"]  # a 3-byte character goes to the token that completes it


def test_pieces_keep_leading_spaces_of_later_tokens():
    words = ["hello", "big", "world"]
    dec = PieceDecoder(lambda ids: " ".join(words[i] for i in ids))
    assert dec.add([0, 1]) + dec.add([2]) == ["hello", " big", " world"]


def _loop_in_thread():
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    return loop, t


def test_scheduler_is_fifo_limits_the_queue_and_withdraws():
    loop, thread = _loop_in_thread()
    order, gate = [], threading.Event()
    sched = Scheduler(max_queue=2, workers=1)
    try:
        def work(tag):
            def run(job):
                if tag == "first":
                    gate.wait(10)
                order.append(tag)
            return run

        jobs = {tag: Job(work(tag), loop, timeout=30) for tag in ("first", "a", "b", "c")}
        sched.submit(jobs["first"])
        sched.submit(jobs["a"])
        sched.submit(jobs["b"])          # the first may not have started yet: still fits
        deadline = time.monotonic() + 10
        while sched.waiting > 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(QueueFull):
            sched.submit(jobs["c"])
        assert sched.withdraw(jobs["a"]) is True
        assert sched.withdraw(jobs["a"]) is False
        sched.submit(jobs["c"])
        gate.set()
        deadline = time.monotonic() + 10
        while len(order) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["first", "b", "c"]
    finally:
        gate.set()
        sched.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_job_timeout_is_reported_by_stop_reason():
    loop = asyncio.new_event_loop()
    job = Job(lambda j: None, loop, timeout=0.01)
    assert job.stop_reason() is None or job.stop_reason() == "timeout"
    time.sleep(0.02)
    assert job.stop_reason() == "timeout"
    job2 = Job(lambda j: None, loop, timeout=30)
    job2.cancel("disconnect")
    job2.cancel("timeout")  # the first reason wins
    assert job2.stop_reason() == "disconnect"
    loop.close()


class _Engine:
    def __init__(self, runner):
        self.runner = runner or object()
        self.verify_cost = None


def test_runner_pool_reuses_by_configuration_and_bounds_idle_runners():
    made = []

    def factory(target, draft=None, runner=None, backend="auto", exact=None, compile=False, **_):
        engine = _Engine(runner)
        made.append(runner is None)
        return engine

    pool = RunnerPool(factory, keep=2)
    e1, k1 = pool.build(None, None, {"method": "ngram"})
    e2, k2 = pool.build(None, None, {"method": "ar"})          # e1 still in use: a second runner
    assert pool.built == 2 and e1.runner is not e2.runner
    pool.release(e1, k1)
    pool.release(e2, k2)
    e3, k3 = pool.build(None, None, {"method": "ngram", "draft_length": 9})
    assert pool.built == 2 and e3.runner in (e1.runner, e2.runner)
    e4, k4 = pool.build(None, None, {"method": "ngram", "backend": "hf"})  # another configuration
    assert pool.built == 3
    pool.release(e3, k3)
    pool.release(e4, k4)
    assert len(pool._idle) == 2  # keep=2 in all: the least recently used one was dropped


def test_metrics_exposition_format():
    m = ServerMetrics()
    m.request_done("/v1/completions", 200, 0.3)
    m.request_done("/v1/completions", 400)
    s = SpecStats(method="ngram", prompt_tokens=5, steps=4, drafted=6, accepted=3, committed=7,
                  drafted_by_position=[4, 2], accepted_by_position=[3, 0], first_token_time=0.02)
    m.step(2)
    m.generation_done(s)
    text = m.render()
    sample = re.compile(r'^[a-z_]+(\{[a-z_]+="[^"]*"(,[a-z_]+="[^"]*")*\})? [-+0-9.eInf]+$')
    for line in text.strip().splitlines():
        assert line.startswith("# HELP ") or line.startswith("# TYPE ") or sample.match(line), line
    assert 'verispec_requests_total{endpoint="/v1/completions",status="400"} 1' in text
    assert "verispec_mean_accepted_length 1.75" in text
    assert 'verispec_acceptance_by_position{position="0"} 0.75' in text
    assert 'verispec_acceptance_by_position{position="1"} 0' in text
    assert "verispec_acceptance_rate 0.5" in text
    buckets = [int(v) for v in re.findall(r'verispec_time_to_first_token_seconds_bucket\{le="[^"]+"\} (\d+)', text)]
    assert buckets == sorted(buckets) and buckets[-1] == 1 and buckets[0] == 0
