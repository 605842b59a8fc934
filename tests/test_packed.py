"""The CPU linear kernels of the fast path (fast/packed.py), and the bf16 hybrid for CPUs without bf16
instructions forced on whatever CPU runs the tests: its arithmetic, which kernel each row count reads,
and the fast path's logits and exact-mode bit-identity on it."""

from __future__ import annotations

import pytest
import torch
from conftest import loaded, tiny_llama

from verispec.api import build_engine
from verispec.backends.fast import FastRunner
from verispec.fast import packed
from verispec.types import SamplingParams

CPU = torch.device("cpu")


@pytest.fixture
def hybrid(monkeypatch):
    """bf16 packing reported unavailable, as on an AVX2-only CPU (float32 packing stays as it is)."""
    if not packed.available(torch.float32, CPU):
        pytest.skip("this torch build has no oneDNN packed linear (the hybrid needs its float32 kernel)")
    real = packed.available
    monkeypatch.setattr(packed, "available", lambda dtype, device: dtype != torch.bfloat16 and real(dtype, device))


def test_hybrid_arithmetic_and_kernel_choice(hybrid):
    pack, linear = packed.linear_for(torch.bfloat16, CPU)
    assert linear is packed._hybrid_linear
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).bfloat16()
    b = torch.randn(48, generator=g).bfloat16()
    pw = pack(w)
    assert torch.equal(pw[0], w)
    # a wrong bf16 copy shows where the one-row kernel is used, and only there
    wrong = (torch.zeros_like(w), pw[1])
    for m in range(1, 10):
        x = torch.randn(m, 40, generator=g).bfloat16()
        got = linear(x, pw, b)
        assert got.dtype == torch.bfloat16 and got.shape == (m, 48)
        exact = x.double() @ w.double().T + b.double()  # bf16 products are exact; sums round in float32
        torch.testing.assert_close(got.double(), exact, atol=1e-2, rtol=2 ** -7)  # one bf16 rounding
        assert torch.equal(linear(x, wrong, b), got) == (m >= packed.HYBRID_ROWS), m


def test_hybrid_fast_path_logits_and_exact_mode(hybrid):
    model = tiny_llama(layers=3, hidden=64).to(torch.bfloat16)
    ids = torch.randint(0, 32, (60,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model(input_ids=ids[None]).logits[0].float()
    runner = FastRunner(model, capacity=128, exact=False)
    assert runner.net.linear is packed._hybrid_linear
    runner.forward(ids[:10], last_only=True)
    got = torch.cat([runner.forward(ids[10:11]).logits, runner.forward(ids[11:30]).logits])
    torch.testing.assert_close(got, ref[10:30], atol=0.15, rtol=0.02)
    # exact mode: a position's logits do not depend on how many positions share its pass, though one-row
    # and wider calls read different kernels (the row-invariance probe must see the switch)
    one = FastRunner(model, capacity=128, exact=True, kv_block=16)
    assert one._natural_floor() is None or one._natural_floor() >= packed.HYBRID_ROWS
    one.forward(ids[:10], last_only=True)
    alone = torch.cat([one.forward(ids[i:i + 1]).logits for i in range(10, 60)])
    many = FastRunner(model, capacity=128, exact=True, kv_block=16)
    many.forward(ids[:10], last_only=True)
    together = torch.cat([many.forward(ids[a:b]).logits for a, b in ((10, 13), (13, 20), (20, 21), (21, 37), (37, 60))])
    assert torch.equal(alone, together)


def test_hybrid_greedy_speculation_equals_plain_decoding(hybrid):
    target = loaded(tiny_llama(layers=3, hidden=64).to(torch.bfloat16))
    draft = loaded(tiny_llama(layers=1, hidden=64, seed=1).to(torch.bfloat16), name="draft")
    params = SamplingParams(max_new_tokens=40)
    for prompt in ([1, 2, 3, 4, 1, 2, 3], [5, 9, 5, 9, 5, 9, 17]):
        plain = build_engine(target, "ar", backend="fast").generate(prompt, params).token_ids
        for method, opts in (("ngram", {}), ("draft", {"draft": draft}), ("ngram", {"tree": "static:small"})):
            assert build_engine(target, method, backend="fast", **opts).generate(prompt, params).token_ids == plain


def test_hybrid_under_torch_compile(hybrid):
    """Compiled passes run their token buckets on the widened copy (an opaque op inductor calls as is):
    the logits of eager passes of the same widths."""
    model = tiny_llama().to(torch.bfloat16)
    ids = torch.randint(0, 32, (14,), generator=torch.Generator().manual_seed(9))
    eager = FastRunner(model, capacity=32, exact=False)
    comp = FastRunner(model, capacity=32, exact=False, compile=True, buckets=(4,))
    for r in (eager, comp):
        r.forward(ids[:8], last_only=True)
    a = torch.cat([eager.forward(ids[8:11]).logits, eager.forward(ids[11:14]).logits])  # 3 rows: the widened kernel
    b = torch.cat([comp.forward(ids[8:11]).logits, comp.forward(ids[11:14]).logits])
    torch.testing.assert_close(b, a, atol=0.05, rtol=0.02)
