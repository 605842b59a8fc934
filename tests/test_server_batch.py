"""verispec serve with continuous batching (issue 19): requests share the engine thread's batch on a
real uvicorn server over a tiny word-level model.

Concurrent greedy requests, each with its own speculation settings, get exactly the text they get
alone; a request joins while another is mid-generation and finishes first; a disconnect or a timeout
of one request leaves the others' outputs intact; the race endpoint runs between batch steps; the
queue counts the batch's free places; bad settings give one clear line.

The engine factory lets a test hold the engine thread at its next step (GATE), so requests pile up
in the queue and are admitted together, and slow each step (DELAY); no assertion depends on timing.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from server_helpers import ServerThread, on_each_step, tiny_target
from verispec.api import build_engine, generate
from verispec.batch import free_positions
from verispec.errors import InvalidParameter
from verispec.server import ServerConfig, create_app

MODEL = "tiny-words"
DELAY = {"s": 0.0}
STEPS = {"n": 0}
GATE = threading.Event()


def _factory(target, **options):
    def held():  # each verification step waits at GATE, is counted, sleeps DELAY
        GATE.wait(30)
        if options.get("draft_length") == 7:  # lets a test break a batch step (a valid value)
            raise RuntimeError("secret drafter failure /etc/passwd")
        STEPS["n"] += 1
        if DELAY["s"]:
            time.sleep(DELAY["s"])
    return on_each_step(build_engine(target, **options), held)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def server(target):
    GATE.set()
    config = ServerConfig(method="ngram", draft_length=4, default_max_tokens=16, max_tokens=64, max_prompt_tokens=40,
                          max_queue=8, timeout=60, max_batch=4, batch_positions=12)
    with ServerThread(create_app(target, config, engine_factory=_factory)) as s:
        yield s
    GATE.set()


@pytest.fixture(autouse=True)
def _reset():
    DELAY["s"] = 0.0
    GATE.set()
    yield
    DELAY["s"] = 0.0
    GATE.set()


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _wait(cond, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _post(server, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0, **body},
                      timeout=timeout)


def _reference(target, messages, max_tokens, **settings):
    """The text a request gets alone: the library's generation with the same settings."""
    options = {"method": "ngram", "draft_length": 4, **settings}
    return generate(target, chat=messages, max_new_tokens=max_tokens, **options).text


def _in_parallel(fns):
    """Run each fn in its own thread -> their results (an exception is returned, not raised)."""
    out = [None] * len(fns)

    def run(i):
        try:
            out[i] = fns[i]()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    return threads, out


def _held_until_queued(server, n_waiting: int):
    """With GATE closed, wait until the engine thread is held inside a step and n_waiting requests queue."""
    _wait(lambda: metric(server, "verispec_running") >= 1 and metric(server, "verispec_queue_length") == n_waiting)


# each request's own speculation settings: plain, prompt lookup with several draft lengths, adaptive, a
# dynamic tree; all greedy, so each must produce exactly its text alone
MIXED = [
    ("the cat sat on the mat and the cat sat", 14, {"method": "ar"}),
    ("the dog ran under the tree and the dog ran", 12, {"method": "ngram", "draft_length": 2}),
    ("one two three one two three one two", 16, {"method": "ngram", "draft_length": 6, "adaptive": True}),
    ("hello world python code function hello world", 10, {"method": "ngram", "tree": "dynamic", "tree_budget": 6}),
    ("red blue green red blue green red", 9, {"method": "ngram", "ngram_max": 2}),
    ("the bird flew over the river and the bird", 13, {}),
]


def test_concurrent_requests_equal_their_one_at_a_time_outputs(server, target):
    steps0, seqs0 = metric(server, "verispec_batch_steps_total"), metric(server, "verispec_batch_sequence_steps_total")
    GATE.clear()  # the first request holds the engine thread inside its first step; the others queue
    first = MIXED[0]
    threads, out = _in_parallel([lambda p=p: _post(server, {"messages": _chat(p[0]), "max_tokens": p[1],
                                                            "verispec": p[2]}) for p in MIXED[:1]])
    _held_until_queued(server, 0)
    more, out_more = _in_parallel([lambda p=p: _post(server, {"messages": _chat(p[0]), "max_tokens": p[1],
                                                              "verispec": p[2]}) for p in MIXED[1:]])
    _held_until_queued(server, len(MIXED) - 1)
    GATE.set()
    for t in threads + more:
        t.join()
    responses = out + out_more
    for (prompt, n, settings), r in zip(MIXED, responses):
        assert not isinstance(r, Exception) and r.status_code == 200, r
        body = r.json()
        assert body["choices"][0]["message"]["content"] == _reference(target, _chat(prompt), n, **settings), settings
        assert body["verispec"]["method"] == settings.get("method", "ngram")
        assert body["usage"]["completion_tokens"] <= n
    assert first[2]["method"] == "ar" and responses[0].json()["verispec"]["drafted"] == 0
    steps = metric(server, "verispec_batch_steps_total") - steps0
    seqs = metric(server, "verispec_batch_sequence_steps_total") - seqs0
    assert seqs > steps, "the requests never shared a step"  # mean batch size > 1
    assert metric(server, "verispec_batch_active_sequences") == 0 and metric(server, "verispec_running") == 0


def test_a_request_joins_mid_generation_and_finishes_first(server, target):
    DELAY["s"] = 0.05
    long_body = {"messages": _chat("the cat sat on the mat"), "max_tokens": 60, "stream": True,
                 "verispec": {"method": "ar"}}
    order = []
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={"model": MODEL, "temperature": 0, **long_body},
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        tokens = 0
        for line in lines:  # a few steps of the long generation first
            if line.startswith("data: {") and '"pieces"' in line:
                tokens += len(json.loads(line[6:])["verispec"]["token_ids"])
            if tokens >= 3:
                break
        short = _post(server, {"messages": _chat("the dog ran"), "max_tokens": 4, "verispec": {"method": "ngram"}})
        order.append("short")
        assert short.status_code == 200
        assert short.json()["choices"][0]["message"]["content"] == _reference(target, _chat("the dog ran"), 4)
        for line in lines:
            if line == "data: [DONE]":
                order.append("long")
                break
            chunk = json.loads(line[6:]) if line.startswith("data: {") else None
            if chunk and "pieces" in (chunk.get("verispec") or {}):
                tokens += len(chunk["verispec"]["token_ids"])
    # the short request did not wait for the long one: it was answered while the stream still ran
    assert order == ["short", "long"] and tokens == 60


def test_disconnect_and_timeout_of_one_request_leave_the_others_intact(server, target):
    DELAY["s"] = 0.02
    gone0 = metric(server, "verispec_generations_cancelled_total", '{reason="disconnect"}')
    late0 = metric(server, "verispec_generations_cancelled_total", '{reason="timeout"}')
    keep = [("the cat sat on the mat and the cat", 30, {"method": "ngram", "draft_length": 3}),
            ("one two three four five one two three", 30, {"method": "ar"})]
    GATE.clear()  # the first request holds the engine thread inside its first step; the other two queue
    first, first_out = _in_parallel([lambda p=keep[0]: _post(server, {"messages": _chat(p[0]), "max_tokens": p[1],
                                                                       "verispec": p[2]})])
    _held_until_queued(server, 0)
    threads, out = _in_parallel(
        [lambda p=keep[1]: _post(server, {"messages": _chat(p[0]), "max_tokens": p[1], "verispec": p[2]})]
        + [lambda: _post(server, {"messages": _chat("big red box"), "max_tokens": 60,  # gives up after 1 s
                                  "verispec": {"method": "ar", "timeout": 1.0}})])
    # on a slow machine the 1-s request can pass its deadline before this sees it queued: withdrawn from the
    # queue as a timeout, it counts as one of the two waiting (the assertions below hold either way)
    late = lambda: metric(server, "verispec_generations_cancelled_total", '{reason="timeout"}') - late0  # noqa: E731
    _wait(lambda: metric(server, "verispec_running") >= 1 and metric(server, "verispec_queue_length") + late() == 2)
    start = STEPS["n"]
    GATE.set()
    # a streaming client that leaves after a few chunks, while the others run
    body = {"model": MODEL, "temperature": 0, "messages": _chat("the dog ran"), "max_tokens": 60, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
    for t in first + threads:
        t.join()
    out = first_out + out
    for (prompt, n, settings), r in zip(keep, out[:2]):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == _reference(target, _chat(prompt), n, **settings)
    assert out[2].status_code == 504 and out[2].json()["error"]["code"] == "timeout"
    _wait(lambda: metric(server, "verispec_generations_cancelled_total", '{reason="disconnect"}') == gone0 + 1)
    _wait(lambda: metric(server, "verispec_generations_cancelled_total", '{reason="timeout"}') == late0 + 1)
    _wait(lambda: metric(server, "verispec_running") == 0)
    ran = STEPS["n"] - start
    time.sleep(0.2)
    assert STEPS["n"] - start == ran, "a cancelled sequence kept stepping"


def test_race_runs_between_batch_steps(server, target):
    DELAY["s"] = 0.02
    GATE.clear()
    threads, out = _in_parallel([lambda: _post(server, {"messages": _chat("the cat sat on the mat"), "max_tokens": 20})])
    _held_until_queued(server, 0)
    race = {"messages": _chat("the cat the cat the cat"), "max_tokens": 8,
            "lanes": [{"method": "ar"}, {"method": "ngram", "draft_length": 3}]}
    events = []

    def run_race():
        with httpx.stream("POST", server.url + "/v1/verispec/race", json=race, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    racer = threading.Thread(target=run_race)
    racer.start()
    _wait(lambda: metric(server, "verispec_queue_length") == 1)
    GATE.set()
    racer.join()
    for t in threads:
        t.join()
    ids = {0: [], 1: []}
    for e in events[1:]:
        if "token_ids" in e:
            ids[e["lane"]].extend(e["token_ids"])
    assert events[0]["lanes"] == ["ar", "ngram"] and ids[0] == ids[1] and len(ids[0]) == 8
    assert out[0].json()["choices"][0]["message"]["content"] == _reference(target, _chat("the cat sat on the mat"), 20)


def test_a_failing_step_ends_its_batch_with_errors_and_the_server_goes_on(server, target):
    GATE.clear()
    fine = {"messages": _chat("the cat sat"), "max_tokens": 6}
    threads, out = _in_parallel([lambda: _post(server, fine)])
    _held_until_queued(server, 0)
    more, out_more = _in_parallel([lambda: _post(server, {**fine, "verispec": {"draft_length": 7}})])
    _held_until_queued(server, 1)
    GATE.set()
    for t in threads + more:
        t.join()
    broken = out_more[0]
    assert broken.status_code == 500 and broken.json()["error"]["code"] == "internal_error"
    assert "secret" not in broken.text and "passwd" not in broken.text
    # the first request shared the failing step: it either finished before or ended with the same error
    assert out[0].status_code in (200, 500)
    _wait(lambda: metric(server, "verispec_running") == 0)
    after = _post(server, fine)
    assert after.status_code == 200
    assert after.json()["choices"][0]["message"]["content"] == _reference(target, _chat("the cat sat"), 6)


def test_queue_counts_the_batch_places_and_metrics_show_the_batch(target):
    GATE.clear()
    config = ServerConfig(method="ar", default_max_tokens=3, max_tokens=8, max_queue=1, timeout=60, max_batch=2,
                          batch_positions=None)
    with ServerThread(create_app(target, config, engine_factory=_factory)) as server:
        body = {"messages": _chat("the cat"), "max_tokens": 3}
        threads, out = _in_parallel([lambda: _post(server, body)])
        _held_until_queued(server, 0)
        more, out_more = _in_parallel([lambda: _post(server, body), lambda: _post(server, body)])
        # one in the batch (held in its step), one about to take the batch's second place, one waiting
        _held_until_queued(server, 2)
        refused = _post(server, body)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
        assert int(refused.headers["Retry-After"]) >= 1
        GATE.set()
        for t in threads + more:
            t.join()
        assert [r.status_code for r in out + out_more] == [200, 200, 200]
        assert metric(server, "verispec_batch_max_sequences") == 2
        assert metric(server, "verispec_batch_positions") == 0
        info = httpx.get(server.url + "/verispec/info").json()
        assert info["limits"]["max_batch"] == 2


def test_auto_positions_come_from_the_measured_cost_curve(target):
    config = ServerConfig(method="ngram", default_max_tokens=3, max_tokens=8, max_batch=3)  # batch_positions "auto"
    with ServerThread(create_app(target, config)) as server:
        assert _post(server, {"messages": _chat("the cat"), "max_tokens": 3}).status_code == 200
        positions = metric(server, "verispec_batch_positions")
        served = server.server.config.app.state.served
        cost = served.verify_cost
        assert positions >= 3 and cost  # the budget of a full batch (3 sequences): at least its 3 rows
        assert all(cost[a] <= cost[b] for a, b in zip(sorted(cost), sorted(cost)[1:]))  # made non-decreasing
        assert positions == free_positions(cost, rows=3)
        three = cost[2] + (cost[4] - cost[2]) / 2  # the curve's cost of 3 positions
        assert positions == 3 or cost[int(positions)] <= 1.25 * three


@pytest.mark.parametrize("field, value", [("max_batch", 0), ("max_batch", -3), ("max_batch", 2.5), ("max_batch", True),
                                          ("batch_positions", 0), ("batch_positions", "many")])
def test_bad_batch_settings_are_refused_in_one_line(field, value):
    with pytest.raises(InvalidParameter) as e:
        ServerConfig(**{field: value})
    assert field in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, needle", [(["--max-batch", "0"], "--max-batch must be >= 1"),
                                          (["--batch-positions", "lots"], "--batch-positions must be"),
                                          (["--batch-positions", "0"], "--batch-positions must be")])
def test_serve_command_refuses_bad_batch_options(args, needle):
    from typer.testing import CliRunner

    from verispec.cli import app

    result = CliRunner().invoke(app, ["serve", *args])
    assert result.exit_code == 2
    out = " ".join(result.output.split())
    assert needle in out and "Traceback" not in result.output
