"""rope.py's kernel: the same bits as the ATen operations it replaces (rotation, casts, the cache write) for
every dtype pair, strided inputs, a row independent of the others, bad input refused, and the switch."""

from __future__ import annotations

import pytest
import torch

from verispec.fast import core, rope

pytestmark = pytest.mark.skipif(rope.available() is not None, reason=f"rope kernel: {rope.available()}")


def _case(T: int, H: int, KVH: int, hd: int, dtype: torch.dtype, seed: int = 0):
    """A projection [T, H + 2 KVH, hd] as the step makes it, and rotary tables for positions 5..5+T."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, H + 2 * KVH, hd, generator=g) * 3).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = core.rope_tables(torch.arange(5, 5 + T), inv, 1.0, dtype)
    return qkv, cos, sin


def _ops(qkv, cos, sin, kv, slots, H, KVH):
    """The ATen operations the kernel replaces (rope.rotate_store's fallback), on a copy of the cache."""
    kv = kv.clone()
    r = rope.rotate(qkv[:, :H + KVH], cos, sin)
    kv.index_copy_(1, slots, torch.cat((r[:, H:], qkv[:, H + KVH:]), dim=1).transpose(0, 1).to(kv.dtype))
    return r[:, :H].transpose(0, 1).to(kv.dtype), kv


@pytest.mark.parametrize("dtype,cache", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                         (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)])
@pytest.mark.parametrize("T", [1, 3, 17])
def test_kernel_equals_the_operations_bit_for_bit(dtype, cache, T):
    H, KVH, hd = 9, 3, 64
    qkv, cos, sin = _case(T, H, KVH, hd, dtype, seed=T)
    kv = torch.randn(2 * KVH, 40, hd).to(cache)
    slots = torch.randperm(40)[:T]
    want_q, want_kv = _ops(qkv, cos, sin, kv, slots, H, KVH)
    got_kv = kv.clone()
    got_q = torch.ops.verispec.rope_store(qkv[:, :H + KVH], qkv[:, H + KVH:], cos, sin, got_kv, slots)
    assert got_q.dtype == cache and got_q.shape == (H, T, hd)
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_kv, want_kv)  # the slots written, every other slot untouched
    if dtype != torch.float32:  # and the roundings matter: one rounding of the float32 sum would differ
        once = (qkv[:, :H].float() * cos.float() + qkv[:, :H].float().roll(hd // 2, -1) * sin.float()).to(dtype)
        assert not torch.equal(once.transpose(0, 1).to(cache), got_q)


def test_rotate_store_is_the_kernel_where_it_runs_and_the_operations_elsewhere(monkeypatch):
    H, KVH, hd, T = 4, 2, 32, 5
    qkv, cos, sin = _case(T, H, KVH, hd, torch.bfloat16, seed=3)
    kv, slots = torch.zeros(2 * KVH, 16, hd), torch.tensor([3, 4, 5, 6, 7])
    calls = []
    real = torch.ops.verispec.rope_store
    want_q, want_kv = _ops(qkv, cos, sin, kv, slots, H, KVH)
    monkeypatch.setattr(torch.ops.verispec, "rope_store", lambda *args: calls.append(1) or real(*args))
    got_kv = kv.clone()
    assert torch.equal(rope.rotate_store(qkv[:, :H + KVH], qkv[:, H + KVH:], cos, sin, got_kv, slots), want_q)
    assert torch.equal(got_kv, want_kv) and calls == [1]
    monkeypatch.setattr(rope, "available", lambda: "off in this test")
    got_kv = kv.clone()
    assert torch.equal(rope.rotate_store(qkv[:, :H + KVH], qkv[:, H + KVH:], cos, sin, got_kv, slots), want_q)
    assert torch.equal(got_kv, want_kv) and calls == [1]  # the operations ran, not the kernel


def test_a_rows_bits_do_not_depend_on_the_other_rows_or_threads():
    H, KVH, hd, T = 9, 3, 64, 40
    qkv, cos, sin = _case(T, H, KVH, hd, torch.bfloat16, seed=7)
    slots = torch.arange(T)
    whole = torch.zeros(2 * KVH, T, hd)
    q = torch.ops.verispec.rope_store(qkv[:, :H + KVH], qkv[:, H + KVH:], cos, sin, whole, slots)
    alone = torch.zeros(2 * KVH, T, hd)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for t in range(T):
            qt = torch.ops.verispec.rope_store(qkv[t:t + 1, :H + KVH], qkv[t:t + 1, H + KVH:], cos[t:t + 1], sin[t:t + 1],
                                               alone, slots[t:t + 1])
            assert torch.equal(qt[:, 0], q[:, t])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, whole)


def test_bad_input_is_refused_with_a_message():
    H, KVH, hd = 4, 2, 32
    qkv, cos, sin = _case(3, H, KVH, hd, torch.float32)
    kv = torch.zeros(2 * KVH, 8, hd)
    with pytest.raises(RuntimeError, match="cos and sin"):
        torch.ops.verispec.rope_store(qkv[:, :H + KVH], qkv[:, H + KVH:], cos[:2], sin[:2], kv, torch.arange(3))
    with pytest.raises(RuntimeError, match="shapes"):
        torch.ops.verispec.rope_store(qkv[:, :H + KVH], qkv[:, H + KVH:], cos, sin, torch.zeros(KVH, 8, hd), torch.arange(3))
    with pytest.raises(RuntimeError, match="slots"):
        torch.ops.verispec.rope_store(qkv[:, :H + KVH], qkv[:, H + KVH:], cos, sin, kv, torch.arange(3, dtype=torch.int32))


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("VERISPEC_ROPE", "0")
    assert rope.OPERATOR.build() == "VERISPEC_ROPE=0"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_passs_rotary_rows_equal_rope_tables_of_its_positions(dtype):
    """FastDecoder keeps the tables of all positions and picks a pass's rows from them (growing past 1024):
    the rows equal rope_tables computed for the pass's own positions, bit for bit."""
    from conftest import tiny_gemma3

    from verispec.backends.fast import FastRunner

    model = tiny_gemma3().to(dtype)  # two rope keys (local and global), with rope scaling
    net = FastRunner(model, capacity=64, exact=False).net
    assert len(net.ropes) == 2
    for pos in (torch.tensor([0]), torch.tensor([5, 6, 7]), torch.tensor([3, 3, 4, 9]), torch.tensor([1500, 2047, 2048])):
        got = net._tables(pos)
        for key, (inv, scaling) in net.ropes.items():
            want = core.rope_tables(pos, inv, scaling, net.dtype)
            assert torch.equal(got[key][0], want[0]) and torch.equal(got[key][1], want[1])
    assert net._rope_tables[next(iter(net.ropes))][0].shape[0] == 3072
