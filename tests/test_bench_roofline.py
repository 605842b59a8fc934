"""The roofline probe: measured points, weight bytes, derived floor and free positions, the plot, and the
hand-off to theory's cost curve; one check on the real SmolLM2."""

from __future__ import annotations

import json

import pytest

from conftest import loaded, tiny_llama
from verispec.bench import roofline as rl
from verispec.bench.report import plot_roofline, write_json
from verispec.errors import InvalidParameter
from verispec.theory import CostCurve

pytestmark = pytest.mark.usefixtures("one_thread")


def test_default_ns():
    assert rl.default_ns(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert rl.default_ns(8) == [1, 2, 4, 8]
    assert rl.default_ns(12) == [1, 2, 4, 8, 12]
    with pytest.raises(InvalidParameter):
        rl.default_ns(0)


def test_roofline_backend_choice():
    """--backend hf times transformers' forward, the runner the engine uses with backend 'hf'."""
    res = rl.measure(loaded(tiny_llama()), context=8, ns=[1, 2], repeats=1, warmup=0, bandwidth_bytes=1 << 20,
                     backend="hf")
    assert res["backend"] == "hf" and [p["n"] for p in res["points"]] == [1, 2]
    with pytest.raises(InvalidParameter):
        rl.measure(loaded(tiny_llama()), context=8, ns=[1], backend="turbo")


def test_roofline_on_tiny_model(tmp_path):
    target = loaded(tiny_llama())
    calls = []
    res = rl.measure(target, context=16, ns=rl.default_ns(8), repeats=3, warmup=1,
                     bandwidth_bytes=8 << 20, progress=calls.append)
    assert calls == [1, 2, 4, 8]
    assert [p["n"] for p in res["points"]] == [1, 2, 4, 8]
    for p in res["points"]:
        assert len(p["times_s"]) == 3 and p["median_s"] > 0 and p["min_s"] <= p["median_s"]
    assert res["points"][0]["ratio"] == 1.0
    assert res["free_positions"] in (1, 2, 4, 8)
    t1 = res["t1_s"]
    assert all(p["median_s"] < 1.25 * t1 for p in res["points"] if p["n"] <= res["free_positions"])
    # weight bytes: every parameter once; streamed leaves out the (untied) input embedding
    total = sum(p.numel() * p.element_size() for p in target.model.parameters())
    emb = target.model.get_input_embeddings().weight
    assert res["weight_bytes"] == {"total": total, "streamed": total - emb.numel() * emb.element_size()}
    assert res["bandwidth"]["gb_per_s"] > 0
    assert res["floor_s"] == pytest.approx(res["weight_bytes"]["streamed"] / (res["bandwidth"]["gb_per_s"] * 1e9))
    table = rl.format_table(res)
    assert "free positions" in table and "bandwidth floor" in table
    assert res["backend"] == "fast" and "fast backend" in table  # the engine's default runner for Llama
    # the cache is left as it was: the probe crops back after every forward
    path = write_json(res, tmp_path / "roof.json")
    png = plot_roofline(json.loads(path.read_text()), tmp_path / "roof.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    curve = CostCurve.from_roofline(path)
    assert curve.ns == [1, 2, 4, 8] and curve.ratio(1) == 1.0


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_forward_is_timed_on_the_fixed_context(backend, monkeypatch):
    """Every timed forward sees exactly `context` cached positions (forward then crop back)."""
    from verispec.backends.fast import FastRunner
    from verispec.backends.transformers import HFRunner

    cls = HFRunner if backend == "hf" else FastRunner
    seen = []
    original = cls.forward

    def spy(self, ids, *args, **kwargs):
        seen.append((self.length, len(ids)))
        return original(self, ids, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", spy)
    rl.measure(loaded(tiny_llama()), context=10, ns=[1, 4], repeats=2, warmup=1, bandwidth_bytes=1 << 20,
               backend=backend)
    assert seen[0] == (0, 10)
    assert seen[1:] == [(10, 1)] * 3 + [(10, 4)] * 3


def test_weight_bytes_counts_tied_embeddings_once():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    wb = rl.weight_bytes(model)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    assert wb["total"] == sum(unique.values()) == wb["streamed"]
    assert wb["total"] < sum(p.numel() * p.element_size() for p in model.state_dict().values())


def test_summarize_free_positions():
    res = {"points": [{"n": n, "median_s": t} for n, t in [(1, 10.0), (2, 10.5), (4, 12.0), (8, 12.4), (16, 20.0)]],
           "weight_bytes": {"total": 100, "streamed": 80}, "bandwidth": {"gb_per_s": 1e-9 * 80 / 2.0}}
    rl.summarize(res)
    assert res["free_positions"] == 8 and res["floor_s"] == pytest.approx(2.0)
    assert res["floor_ratio"] == pytest.approx(5.0)
    assert [p["ratio"] for p in res["points"]] == pytest.approx([1.0, 1.05, 1.2, 1.24, 2.0])


def test_bad_settings():
    target = loaded(tiny_llama())
    with pytest.raises(InvalidParameter, match="exceeds"):
        rl.measure(target, context=400, ns=[1, 256])
    with pytest.raises(InvalidParameter):
        rl.measure(target, context=0, ns=[1])
    with pytest.raises(InvalidParameter):
        rl.measure(target, context=8, ns=[1], repeats=0)


@pytest.mark.real_model
def test_roofline_smollm2_small(smollm2):
    """SmolLM2-135M: ~135M parameters in float32 (tied embeddings counted once)."""
    res = rl.measure(smollm2, context=32, ns=[1, 4], repeats=2, warmup=1, bandwidth_bytes=64 << 20)
    assert 125e6 * 4 < res["weight_bytes"]["total"] < 140e6 * 4
    assert res["weight_bytes"]["streamed"] == res["weight_bytes"]["total"]  # tied: the head reads the matrix
    assert res["t1_s"] > res["floor_s"] > 0
