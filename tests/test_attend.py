"""attend.py's exact-mode attention kernel: the value canonical.py's PyTorch operations compute (within
float32 summation error), and a row's bits that depend only on its own query and the keys and values at
the positions it sees: not on their cache slots, the other rows of the pass, the attended length or the
thread count."""

from __future__ import annotations

import pytest
import torch

from verispec.fast import attend, canonical

pytestmark = pytest.mark.skipif(attend.available() is not None, reason=f"attention kernel: {attend.available()}")


def _case(H=6, KVH=2, D=64, S=160, T=5, p0=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(KVH, S, D, generator=g), torch.randn(KVH, S, D, generator=g)
    q = torch.randn(H, T, D, generator=g)
    pos = torch.arange(p0, p0 + T)
    return q, k, v, pos


def _bias(pos, L, g):
    return canonical.bias(torch.arange(L)[None, :] <= pos[:, None], g)


@pytest.mark.parametrize("D", [8, 24, 64, 80, 128])
def test_the_kernel_computes_attention(D):
    q, k, v, pos = _case(D=D)
    L = 112
    b = _bias(pos, L, 3)
    got = attend.attention(q, k, v, b, D ** -0.5, None)
    want = canonical.attention_ops(q, k, v, b, D ** -0.5, canonical.plan(pos, L, None))
    # float64 softmax attention over each row's visible keys, as a second reference
    kk, vv = k.double().repeat_interleave(3, 0)[:, :L], v.double().repeat_interleave(3, 0)[:, :L]
    s = (q.double() @ kk.transpose(1, 2)) * D ** -0.5 + b[:len(pos)].double()
    exact = torch.softmax(s, -1) @ vv
    torch.testing.assert_close(got.double(), exact, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert torch.isfinite(got).all()


def test_a_rows_bits_do_not_depend_on_its_keys_slots_company_length_or_threads():
    q, k, v, pos = _case(T=6, p0=100)
    T, L = 6, 112
    ref = attend.attention(q, k, v, _bias(pos, L, 3), 0.125, None)
    # each row alone, and over a longer attended length (its extra columns masked)
    for t in range(T):
        alone = attend.attention(q[:, t:t + 1].contiguous(), k, v, _bias(pos[t:t + 1], 144, 3), 0.125, None)
        assert torch.equal(alone[:, 0], ref[:, t])
    # the last 20 keys moved to other slots (a tree's layout), order mapping each column to its slot
    perm = torch.arange(L)
    perm[90:110] = torch.arange(130, 150).flip(0)
    k2, v2 = k.clone(), v.clone()
    k2[:, perm], v2[:, perm] = k[:, :L], v[:, :L]
    moved = attend.attention(q, k2, v2, _bias(pos, L, 3), 0.125, perm.expand(T, L).contiguous())
    assert torch.equal(moved, ref)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(attend.attention(q, k, v, _bias(pos, L, 3), 0.125, None), ref)
    finally:
        torch.set_num_threads(threads)


def test_a_heads_bits_do_not_depend_on_the_heads_that_share_its_keys():
    """The query heads of one kv head run together over the same blocks of keys (one read of the cache for
    all of them); each gets the bits it gets alone, for lengths that end inside a block and past a span."""
    for T, L, p0 in ((3, 112, 90), (2, 150, 140)):
        q, k, v, pos = _case(H=6, KVH=2, T=T, p0=p0, S=160)
        b = _bias(pos, L, 3)
        together = attend.attention(q, k, v, b, 0.125, None)
        for h in range(6):
            kv = h // 3
            alone = attend.attention(q[h:h + 1].contiguous(), k[kv:kv + 1], v[kv:kv + 1], b, 0.125, None)
            assert torch.equal(alone[0], together[h])


def test_canonical_attention_runs_the_kernel_on_float32_cpu_caches_only():
    q, k, v, pos = _case()
    assert attend.runs_on(k) and not attend.runs_on(k.double()) and not attend.runs_on(torch.zeros(2, 8, 264))
    plan = canonical.plan(pos, 112, None)
    assert torch.equal(canonical.attention(q, k, v, _bias(pos, 112, 3), 0.125, plan),
                       attend.attention(q, k, v, _bias(pos, 112, 3), 0.125, None))
    assert "cuts" not in plan._derived  # the PyTorch operations' index tensors were never built


def test_bad_input_is_one_error():
    q, k, v, pos = _case()
    with pytest.raises(RuntimeError, match="float32"):
        attend.attention(q.double(), k, v, _bias(pos, 112, 3), 0.125, None)
    with pytest.raises(RuntimeError, match="order"):
        attend.attention(q, k, v, _bias(pos, 112, 3), 0.125, torch.zeros(2, 112, dtype=torch.long))


def test_verispec_attend_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("VERISPEC_ATTEND", "0")
    assert attend.OPERATOR.build() == "VERISPEC_ATTEND=0"
