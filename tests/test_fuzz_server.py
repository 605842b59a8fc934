"""Schema fuzzing of the server: schemathesis builds requests from the app's own /openapi.json, valid
ones and deliberately invalid ones (wrong types, missing fields, broken JSON), for every operation, and
sends each in-process to the app serving a tiny model.

Every response must be one the API defines: never a 500; a 504 only as the OpenAI "timeout" error of a
request whose own "verispec.timeout" passed; every 4xx an OpenAI error object with a one-line message
and no trace of the code behind it. Most generated bodies name the served model, so they get past the
model check and reach tokenization, option checks and the engine.

A schema says what a field's type is, so schemathesis rarely sends the values at its edges that broke
the server before (temperature 5e-324, seed 2**64, a lone surrogate, [true] as token ids, a string
tree path). The second test puts such awkward JSON values into every field the schema names, one
field at a time, on an otherwise valid request.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

schemathesis = pytest.importorskip("schemathesis")  # a dev dependency (pyproject's dev extra)
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from server_helpers import tiny_target  # noqa: E402
from verispec.server import ServerConfig, create_app  # noqa: E402

CASES = 1200
MODEL = "tiny-words"
BASE = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "the cat"}]}


@pytest.fixture(scope="module")
def app():
    config = ServerConfig(method="ngram", default_max_tokens=4, max_tokens=8, max_prompt_tokens=64, max_queue=4,
                          timeout=30, allowed_hosts=("testserver",))
    return create_app(tiny_target(), config)


@pytest.fixture(scope="module")
def schema(app):
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def _one_line_error(response) -> dict:
    text = response.text
    assert "Traceback" not in text and 'File "' not in text and "site-packages" not in text, text[:500]
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"], err
    return err


def test_schema_fuzz_no_server_errors(schema):
    operations = [result.ok() for result in schema.get_all_operations()]
    posts = [op for op in operations if op.method.upper() == "POST"]
    assert {op.path for op in posts} == {"/v1/chat/completions", "/v1/completions", "/v1/verispec/race"}
    # the POST operations take bodies, where the bugs were: weight them three to one
    strategies = [op.as_strategy(generation_mode=mode) for op in posts
                  for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)] * 3
    strategies += [op.as_strategy() for op in operations if op not in posts]
    seen: Counter = Counter()

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=st.one_of(strategies), served_model=st.integers(0, 3))
    def run(case, served_model):
        if isinstance(case.body, dict) and "model" in case.body and served_model:
            case.body["model"] = MODEL
        response = case.call()
        seen[response.status_code] += 1
        status = response.status_code
        assert status != 500, f"{case.method} {case.path} {case.body!r:.300} -> {response.text[:300]}"
        if status == 504:
            assert _one_line_error(response)["code"] == "timeout"
            body = case.body if isinstance(case.body, dict) else {}
            assert isinstance(body.get("verispec"), dict) and body["verispec"].get("timeout") is not None
        else:
            assert status < 500, f"{case.method} {case.path} {case.body!r:.300} -> {status} {response.text[:300]}"
        if 400 <= status < 500:
            _one_line_error(response)

    run()
    total = sum(seen.values())
    print(f"schema fuzz cases: {total}, by status: {dict(sorted(seen.items()))}")
    assert total >= 300, seen
    # the fuzzer reached the engine: generations ran, and bad values were refused, not crashed on
    assert seen[200] >= 30 and seen[400] >= 60, seen


# values at the edges of what JSON can say, where the server broke before
AWKWARD = [None, True, False, 0, -1, 1, 5e-324, 1e-300, 1e-40, 1e-5, 0.5, 2.5, 1e308, -1e308, 2 ** 31, 2 ** 53 + 1,
           2 ** 63, 2 ** 64, -(2 ** 63) - 1, 10 ** 30, 999999, "", "yes", "a\ud800b", "\udfff", "x" * 5000,
           [], [True], [1.5], ["ab"], [[999999]], [[0], [1, "x"]], {}, {"a": [None]}]


def test_awkward_values_in_every_field(app):
    from fastapi.testclient import TestClient

    with TestClient(app) as client:
        doc = client.get("/openapi.json").json()["components"]["schemas"]
        top = sorted(set(doc["ChatCompletionRequest"]["properties"]) - {"model"})
        options = sorted(doc["SpeculationOptions"]["properties"])
        assert {"temperature", "seed", "verispec"} <= set(top) and {"tree", "ngram_max", "exact"} <= set(options)
        seen: Counter = Counter()
        fields = top + [f"verispec.{o}" for o in options] + ["messages.0.content", "prompt"]
        for field in fields:
            for value in AWKWARD:
                body, path = json.loads(json.dumps(BASE)), "/v1/chat/completions"
                if field.startswith("verispec."):
                    body["verispec"] = {field.split(".", 1)[1]: value}
                elif field == "messages.0.content":
                    body["messages"][0]["content"] = value
                elif field == "prompt":
                    path = "/v1/completions"
                    del body["messages"]
                    body["prompt"] = value
                else:
                    body[field] = value
                r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
                seen[r.status_code] += 1
                if r.status_code == 504 and field == "verispec.timeout":  # its own deadline passed: defined
                    assert _one_line_error(r)["code"] == "timeout"
                    continue
                assert r.status_code < 500, f"{field} = {value!r:.200} -> {r.status_code} {r.text[:300]}"
                if r.status_code >= 400:
                    _one_line_error(r)
    print(f"awkward-value cases: {sum(seen.values())} ({len(fields)} fields x {len(AWKWARD)} values), "
          f"by status: {dict(sorted(seen.items()))}")
    assert seen[200] >= 50 and seen[400] >= 300, seen
