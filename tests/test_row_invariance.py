"""Exact mode's natural row counts: the probe of row_invariance.py finds where a linear kernel stops
depending on the row count, and a runner that uses it computes fewer rows with the same bits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import tiny_llama

from verispec.backends.fast import FastRunner, PassMode
from verispec.fast.row_invariance import row_floor

SHAPES = [(48, 40), (40, 96)]


def _reversed_below(m0: int):
    """A linear that sums the inner dimension in reverse order for fewer than m0 rows (as a kernel that
    switches to a GEMV path would): same value, other rounding."""
    def linear(x, w, b=None):
        if x.shape[0] < m0:
            return _row_by_row(x.flip(-1), w.flip(-1), b)
        return _row_by_row(x, w, b)
    return linear


def _row_by_row(x, w, b=None):
    """Row-invariant by construction: every row is its own 1-row call."""
    return torch.cat([F.linear(x[i:i + 1], w, b) for i in range(x.shape[0])])


def test_the_probe_finds_the_row_count_a_kernel_changes_at():
    ident = lambda w: w  # noqa: E731
    for dtype in (torch.float32, torch.bfloat16):
        assert row_floor(ident, _row_by_row, SHAPES, 8, dtype, torch.device("cpu")) == 1
        # float32 GEMMs over 96 products round differently when summed backwards: the cancelling probe rows
        # make that visible even through a bfloat16 output
        assert row_floor(ident, _reversed_below(3), SHAPES, 8, dtype, torch.device("cpu")) == 3
        assert row_floor(ident, _reversed_below(8), SHAPES, 8, dtype, torch.device("cpu")) is None


def test_the_attention_probe_finds_a_row_dependent_attention(monkeypatch):
    from verispec.fast import canonical
    from verispec.fast.row_invariance import attention_row_floor

    cpu = torch.device("cpu")
    assert attention_row_floor(4, 2, 16, 8, (16, 32), torch.float32, cpu) is not None
    real = canonical.attention

    def fewer_rows_otherwise(q, k, v, bias, scale, plan):  # another rounding below 5 rows
        out = real(q, k, v, bias, scale, plan)
        return out * (1 + 2 ** -20) if q.shape[1] < 5 else out
    monkeypatch.setattr(canonical, "attention", fewer_rows_otherwise)
    assert attention_row_floor(4, 2, 16, 8, (16, 32), torch.float32, cpu) == 5


def _count_rows(monkeypatch, runner, seen: list) -> None:
    """Append the row count of every pass `runner` runs to `seen`."""
    real = runner.net.forward_parts

    def spy(parts, *a, **k):
        seen.append(sum(int(p.ids.numel()) for p in parts))
        return real(parts, *a, **k)
    monkeypatch.setattr(runner.net, "forward_parts", spy)


def test_exact_mode_computes_natural_rows_with_the_same_bits(monkeypatch):
    for dtype in (torch.float32, torch.bfloat16):
        model = tiny_llama(layers=3, hidden=64).to(dtype)
        ids = torch.randint(0, 32, (40,), generator=torch.Generator().manual_seed(3))
        out, seen = [], []
        for natural in (False, True):  # the spy last: runners of one model share one module (net)
            runner = FastRunner(model, capacity=128, exact=PassMode.of(True, natural_rows=natural), exact_bucket=8,
                                exact_max_rows=8)
            if natural:
                floor = runner.net.row_floor(8, runner.kv_block)
                _count_rows(monkeypatch, runner, seen)
            runner.forward(ids[:10], last_only=True)
            out.append(torch.cat([runner.forward(ids[a:b]).logits for a, b in ((10, 11), (11, 14), (14, 15), (15, 40))]))
        assert torch.equal(out[0], out[1]), dtype
        # oneDNN's packed linear and canonical attention pass the probes on this project's CPUs; where they
        # do not, passes keep exact_bucket rows
        assert floor is not None or not runner.net.packed
        if floor is not None:  # a 1-token pass runs max(1, floor) rows, not 8
            f = max(1, floor)
            assert seen == [10, f, max(3, f), f, 8, 8, 8, f]


def test_exact_passes_take_up_to_exact_max_rows_tokens(monkeypatch):
    """With row-invariant kernels an exact pass takes up to exact_max_rows tokens (a 16-node tree in one
    pass, not two of exact_bucket), with the bits of passes of at most 8."""
    model = tiny_llama(layers=2, hidden=64).to(torch.bfloat16)
    ids = torch.randint(0, 32, (100,), generator=torch.Generator().manual_seed(4))
    out, seen = [], []
    for max_rows in (8, 32):  # the spy last: runners of one model share one module (net)
        runner = FastRunner(model, capacity=256, exact=True, exact_max_rows=max_rows)
        if runner.net.row_floor(32, runner.kv_block) is None:  # kernels not row-invariant: nothing to compare
            assert not runner.net.packed
            return
        if max_rows == 32:
            _count_rows(monkeypatch, runner, seen)
        runner.forward(ids[:10], last_only=True)
        out.append(torch.cat([runner.forward(ids[a:b]).logits for a, b in ((10, 35), (35, 75), (75, 76))]))
    assert torch.equal(out[0], out[1])
    assert seen[1:] == [25, 32, 8, max(1, runner.net.row_floor(32, runner.kv_block))]
