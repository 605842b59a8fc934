"""verispec serve: the official openai client against a real uvicorn server on loopback, on a tiny
word-level model; every error path; client disconnect; queue and timeout; metrics; the race endpoint.

The engine factory is wrapped so a test can slow every step down (DELAY) and count the steps the
engine really ran (STEPS), which is how cancellation is checked without timing assertions. This
module's server runs one generation at a time (max_batch 1); test_server_batch.py batches.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from server_helpers import ServerThread, on_each_step, tiny_target
from verispec.api import build_engine, generate
from verispec.server import ServerConfig, create_app

KEY = "test-key-123"
MODEL = "tiny-words"
DELAY = {"s": 0.0}
STEPS = {"n": 0}


def _step():
    """Each verification step: counted in STEPS, DELAY slept."""
    STEPS["n"] += 1
    if DELAY["s"]:
        time.sleep(DELAY["s"])


def _factory(target, **options):
    if options.get("ngram_max") == 31:  # lets a test provoke an unexpected internal error (a valid value)
        raise RuntimeError("secret internal detail /etc/passwd")
    return on_each_step(build_engine(target, **options), _step)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def server(target):
    config = ServerConfig(method="ngram", draft_length=4, default_max_tokens=16, max_tokens=64, max_prompt_tokens=40,
                          max_body_bytes=4096, max_queue=1, timeout=60, api_key=KEY)
    with ServerThread(create_app(target, config, engine_factory=_factory)) as s:
        yield s


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(autouse=True)
def _no_delay():
    DELAY["s"] = 0.0
    yield
    DELAY["s"] = 0.0


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def metric(server, name: str, labels: str = "") -> float:
    text = httpx.get(server.url + "/metrics", headers=auth()).text  # /metrics needs the key when one is set
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def assert_alive(client):
    """The server still answers a real generation."""
    r = client.completions.create(model=MODEL, prompt="the cat", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


CHAT = [{"role": "system", "content": "you are a cat"}, {"role": "user", "content": "hello the cat sat on the mat"}]


# --------------------------------------------------------------------------- happy paths
def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_matches_library_and_reports_usage_and_stats(client, target):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    ref = generate(target, chat=CHAT, method="ngram", draft_length=4, max_new_tokens=12)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ref.finish_reason
    assert r.usage.prompt_tokens == len(target.encode(chat=CHAT))
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    stats = r.model_extra["verispec"]
    assert stats["method"] == "ngram"
    assert stats["drafted"] == ref.stats.drafted and stats["accepted"] == ref.stats.accepted
    assert stats["steps"] == ref.stats.steps
    assert stats["mean_accepted_length"] == pytest.approx(ref.stats.mean_accepted_length, abs=1e-3)


def test_chat_streaming_equals_non_streaming_and_colours_every_token(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    steps = [c.model_extra["verispec"] for c in chunks if "pieces" in (c.model_extra.get("verispec") or {})]
    assert sum(len(s["token_ids"]) for s in steps) == full.usage.completion_tokens
    for s in steps:
        assert len(s["kinds"]) == len(s["token_ids"]) == len(s["pieces"])
        assert set(s["kinds"]) <= {"accepted", "recovered", "bonus"}
        assert s["kinds"][:-1] == ["accepted"] * (len(s["kinds"]) - 1)  # only the last of a step is not a draft
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].usage.completion_tokens == full.usage.completion_tokens
    assert finals[0].model_extra["verispec"]["stats"]["steps"] == len(steps)
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens


def test_completions_stream_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="the dog ran", max_tokens=10, temperature=0)
    text = r.choices[0].text
    assert r.object == "text_completion" and r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="the dog ran", max_tokens=10, temperature=0, stream=True))
    assert streamed == text
    word = text.split()[2]
    cut = client.completions.create(model=MODEL, prompt="the dog ran", max_tokens=10, temperature=0, stop=[word])
    assert cut.choices[0].finish_reason == "stop"
    assert word not in cut.choices[0].text and text.startswith(cut.choices[0].text)


def test_per_request_speculation_settings(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    plain = client.chat.completions.create(**args, extra_body={"verispec": {"method": "ar"}})
    spec = client.chat.completions.create(**args, extra_body={"verispec": {"method": "ngram", "draft_length": 2,
                                                                           "ngram_max": 2, "adaptive": True}})
    assert plain.model_extra["verispec"]["method"] == "ar" and plain.model_extra["verispec"]["drafted"] == 0
    assert spec.model_extra["verispec"]["method"] == "ngram"
    assert plain.choices[0].message.content == spec.choices[0].message.content  # greedy: lossless


def test_seeded_sampling_is_reproducible(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=10, temperature=1.0, top_p=0.9, seed=7)
    a = client.chat.completions.create(**args).choices[0].message.content
    b = client.chat.completions.create(**args).choices[0].message.content
    assert a == b


def test_race_lanes_agree_under_greedy(server):
    body = {"messages": [{"role": "user", "content": "the cat the cat the cat"}], "max_tokens": 10,
            "lanes": [{"method": "ar"}, {"method": "ngram", "draft_length": 3}]}
    events = []
    with httpx.stream("POST", server.url + "/v1/verispec/race", json=body, headers=auth(), timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    assert events[0]["lanes"] == ["ar", "ngram"]
    ids = {0: [], 1: []}
    for e in events[1:]:
        if not e.get("done"):
            ids[e["lane"]].extend(e["token_ids"])
    done = {e["lane"]: e for e in events if e.get("done")}
    assert set(done) == {0, 1}
    assert ids[0] == ids[1] and len(ids[0]) == 10
    assert done[0]["stats"]["drafted"] == 0 and done[1]["stats"]["method"] == "ngram"
    assert all(d["elapsed"] > 0 for d in done.values())


def test_page_health_and_metrics(server, client):
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "/static/app.js" in page.text
    assert httpx.get(server.url + "/static/app.js").status_code == 200
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    info = httpx.get(server.url + "/verispec/info").json()
    assert info["api_key_required"] is True and "ngram" in info["methods"] and "draft" not in info["methods"]
    before = metric(server, "verispec_generated_tokens_total")
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0)
    text = httpx.get(server.url + "/metrics", headers=auth()).text
    assert metric(server, "verispec_generated_tokens_total") == before + 5
    for name in ("verispec_requests_total", "verispec_drafted_tokens_total", "verispec_accepted_tokens_total",
                 "verispec_mean_accepted_length", "verispec_acceptance_by_position",
                 "verispec_time_to_first_token_seconds_bucket", "verispec_request_latency_seconds_count"):
        assert name in text
    assert 'verispec_requests_total{endpoint="/v1/chat/completions",status="200"}' in text


# --------------------------------------------------------------------------- error paths
def _error(resp: httpx.Response, status: int, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    assert "Traceback" not in resp.text and 'File "' not in resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


def test_malformed_json(server, client):
    r = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": "tiny-words", "messages": [',
                   headers={**auth(), "Content-Type": "application/json"})
    assert "JSON" in _error(r, 400, "invalid_json")["message"]
    r = httpx.post(server.url + "/v1/chat/completions", content=b"[1, 2]", headers={**auth(), "Content-Type": "application/json"})
    _error(r, 400)
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL}, headers=auth())
    assert _error(r, 400, "missing_field")["param"] == "messages"
    assert_alive(client)


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=CHAT)
    assert e.value.code == "model_not_found" and e.value.param == "model" and MODEL in e.value.message


@pytest.mark.parametrize("field,value", [("temperature", 3.0), ("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.5)])
def test_sampling_out_of_range(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, **{field: value})
    assert e.value.param == field and e.value.status_code == 400


def test_max_tokens_too_large(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=65)
    assert e.value.param == "max_tokens" and "at most 64" in e.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=0)


def test_prompt_too_long(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "the cat " * 30}])
    assert e.value.code == "context_length_exceeded" and "at most 40" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="   ")
    assert e.value.code == "invalid_prompt"
    assert_alive(client)


def test_body_too_large(server, client):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "a " * 3000}]}
    r = httpx.post(server.url + "/v1/chat/completions", json=big, headers=auth())
    _error(r, 413, "request_too_large")

    def chunks():  # no Content-Length: the actual size must be counted
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i:i + 1000]

    r = httpx.post(server.url + "/v1/chat/completions", content=chunks(), headers={**auth(), "Content-Type": "application/json"})
    _error(r, 413, "request_too_large")
    assert_alive(client)


def test_api_key(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.code == "invalid_api_key"
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT})
    _error(r, 401, "missing_api_key")
    assert httpx.get(server.url + "/health").status_code == 200  # /health and / need no key


def test_unsupported_fields_and_routes(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, n=2)
    assert e.value.param == "n"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True)
    assert e.value.param == "logprobs"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"verispec": {"method": "medusa9"}})
    assert e.value.param == "verispec.method" and "ngram" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"verispec": {"flux": 1}})
    assert e.value.param == "verispec.flux"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"verispec": {"method": "draft"}})
    assert "--draft" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"verispec": {"draft": "/tmp/model"}})
    assert e.value.param == "verispec.draft"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"verispec": {"compile": True}})
    assert e.value.param == "verispec.compile" and "server setting" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"verispec": {"head": "/etc"}})
    assert e.value.param == "verispec.head"
    # a value only the engine can judge: refused when the engine is built, still as a 400 (streaming too)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=CHAT, stream=stream,
                                           extra_body={"verispec": {"ngram_min": 3, "ngram_max": 2}})
        assert "min_n" in e.value.message and e.value.param == "verispec"
    _error(httpx.get(server.url + "/v1/nothing", headers=auth()), 404, "not_found")
    _error(httpx.get(server.url + "/v1/chat/completions", headers=auth()), 405)


def test_internal_error_is_generic(server, client):
    r = httpx.post(server.url + "/v1/chat/completions", headers=auth(),
                   json={"model": MODEL, "messages": CHAT, "verispec": {"ngram_max": 31}})
    err = _error(r, 500, "internal_error")
    assert "secret" not in r.text and "passwd" not in r.text and err["type"] == "server_error"
    assert_alive(client)


def _wait(cond, seconds=20.0):
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_client_disconnect_stops_generation(server, client):
    DELAY["s"] = 0.05
    cancelled = metric(server, "verispec_generations_cancelled_total", '{reason="disconnect"}')
    start = STEPS["n"]
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 60, "temperature": 0, "stream": True,
            "verispec": {"method": "ar"}}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=auth(), timeout=30) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break
    # leaving the block closed the connection mid-stream
    _wait(lambda: metric(server, "verispec_generations_cancelled_total", '{reason="disconnect"}') == cancelled + 1)
    ran = STEPS["n"] - start
    time.sleep(0.3)
    assert STEPS["n"] - start == ran, "the engine kept stepping after the client left"
    assert ran < 60  # plain decoding: one token per step; 60 steps would be the whole generation
    DELAY["s"] = 0.0
    assert_alive(client)


def test_non_streaming_disconnect_withdraws_queued_request(server, client):
    DELAY["s"] = 0.1
    errors = []
    blocker = threading.Thread(target=lambda: _swallow(errors, lambda: client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=15, temperature=0)))
    blocker.start()
    _wait(lambda: metric(server, "verispec_running") == 1)
    cancelled = metric(server, "verispec_generations_cancelled_total", '{reason="disconnect"}')
    # a queued non-streaming request whose client gives up: it must leave the queue, never run
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=auth(), timeout=0.5,
                   json={"model": MODEL, "prompt": "the dog", "max_tokens": 15})
    _wait(lambda: metric(server, "verispec_generations_cancelled_total", '{reason="disconnect"}') == cancelled + 1)
    assert metric(server, "verispec_queue_length") == 0
    blocker.join()
    assert not errors
    DELAY["s"] = 0.0
    assert_alive(client)


def _swallow(errors, fn):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to the test through the list
        errors.append(exc)


def test_queue_full_gives_429_then_recovers(server, client):
    DELAY["s"] = 0.3  # the first request runs >= 2.4 s: time to queue the second behind it
    errors = []
    args = dict(model=MODEL, prompt="the cat", max_tokens=8, temperature=0)
    first = threading.Thread(target=lambda: _swallow(errors, lambda: client.completions.create(**args)))
    first.start()
    _wait(lambda: metric(server, "verispec_running") == 1)
    second = threading.Thread(target=lambda: _swallow(errors, lambda: client.completions.create(**args)))
    second.start()
    _wait(lambda: metric(server, "verispec_queue_length") == 1)
    with pytest.raises(openai.RateLimitError) as e:  # max_queue=1: one running, one waiting, this one refused
        client.completions.create(**args)
    assert e.value.code == "queue_full" and e.value.status_code == 429
    first.join()
    second.join()
    assert not errors  # the two admitted requests were served in full
    DELAY["s"] = 0.0
    assert_alive(client)


def test_timeout(server, client):
    DELAY["s"] = 0.1
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model=MODEL, prompt="the cat", max_tokens=40, temperature=0,
                                  extra_body={"verispec": {"timeout": 0.5}})
    assert e.value.status_code == 504 and e.value.code == "timeout"
    stream = client.completions.create(model=MODEL, prompt="the cat", max_tokens=40, temperature=0, stream=True,
                                       extra_body={"verispec": {"timeout": 0.5}})
    with pytest.raises(openai.APIError) as e:
        for _ in stream:
            pass
    assert e.value.code == "timeout"
    DELAY["s"] = 0.0
    assert metric(server, "verispec_generations_cancelled_total", '{reason="timeout"}') >= 2
    assert_alive(client)


def test_cli_rejects_bad_options():
    from typer.testing import CliRunner

    from verispec.cli import app

    r = CliRunner().invoke(app, ["serve", "--method", "bogus"])
    assert r.exit_code == 2 and "unknown method" in r.output and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["serve", "--method", "draft"])
    assert r.exit_code == 2 and "--draft" in r.output
    r = CliRunner().invoke(app, ["serve", "--threads", "0"])
    assert r.exit_code == 2 and "--threads" in r.output
    r = CliRunner().invoke(app, ["serve", "--help"])
    assert r.exit_code == 0 and "127.0.0.1" in r.output


def test_runners_are_reused_across_requests(server, client):
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    built = metric(server, "verispec_runners_built_total")
    assert built >= 1
    for k in (2, 3, 6):
        for method in ("ngram", "ar"):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                           extra_body={"verispec": {"method": method, "draft_length": k}})
    assert metric(server, "verispec_runners_built_total") == built
