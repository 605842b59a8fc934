"""The native layer step (verispec/fast/native.py) against the Python one (core.layer_step), the reference:
the same bits for every pass shape, dtype, weights format, exact mode (canonical attention between the
native halves) and not, trees, sliding windows and captured features; where it does not apply, the
Python step runs."""

from __future__ import annotations

import shutil
import types

import pytest
import torch
from conftest import tiny_gemma3, tiny_llama

from verispec.backends import TreeMask
from verispec.backends.fast import FastRunner
from verispec.fast import native, quant

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_mistral(layers: int = 2, window: int = 12):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        sliding_window=window, bos_token_id=0, pad_token_id=0, eos_token_id=None,
                        tie_word_embeddings=False)
    return MistralForCausalLM(cfg).eval()


def test_the_native_step_is_built_where_a_compiler_is():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        assert native.module() is None and "unavailable" in native.status()
    else:
        assert native.module() is not None, native.status()


def test_verispec_native_0_turns_it_off(monkeypatch):
    monkeypatch.setenv("VERISPEC_NATIVE", "0")
    assert native.OPERATOR.build() == "VERISPEC_NATIVE=0"


@pytest.fixture
def calls(monkeypatch):
    """Counts the native entry points each pass calls (None when the extension is not built)."""
    real = native.module()
    if real is None:
        pytest.fail(native.status())
    seen: dict[str, int] = {}

    def counted(name):
        def f(*args):
            seen[name] = seen.get(name, 0) + 1
            return getattr(real, name)(*args)
        return f
    monkeypatch.setattr(native, "module", lambda: types.SimpleNamespace(
        **{name: counted(name) for name in ("layers", "layers_canonical")}))
    return seen


def _passes(runner: FastRunner, ids: torch.Tensor) -> torch.Tensor:
    """Prefill, chain passes of 3, 1 and 16 tokens, and a 4-node tree -> every logit row, concatenated."""
    out = [runner.forward(ids[:20], last_only=True).logits, runner.forward(ids[20:23]).logits, runner.forward(ids[23:24]).logits,
           runner.forward(ids[24:40]).logits]
    anc = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    out.append(runner.forward(ids[40:44], tree=TreeMask(anc, torch.tensor([0, 1, 1, 2]))).logits)
    return torch.cat(out)


CASES = [("llama", torch.float32, "bf16"), ("llama", torch.bfloat16, "bf16"), ("llama", torch.bfloat16, "q8"),
         ("llama", torch.bfloat16, "q4"), ("mistral", torch.float32, "bf16")]


@pytest.mark.parametrize("family,dtype,fmt", CASES)
@pytest.mark.parametrize("exact", [False, True])
def test_native_passes_equal_the_python_step_bit_for_bit(family, dtype, fmt, exact, calls):
    model = (tiny_llama(layers=3, hidden=64) if family == "llama" else tiny_mistral()).to(dtype)
    ids = torch.randint(0, 32, (60,), generator=torch.Generator().manual_seed(3))
    got = {}
    for use in (False, True):
        r = FastRunner(model, capacity=128, exact=exact, weights=fmt, native=use)
        got[use] = _passes(r, ids)
    assert r.net.weights == fmt
    assert torch.equal(got[True], got[False])
    # a pass is one native call for all layers (in exact mode with canonical attention; the prefill is
    # not an exact-shape pass)
    if exact:  # 4 passes or more: without row-invariant kernels 16 tokens take two passes of exact_bucket
        assert set(calls) == {"layers", "layers_canonical"} and calls["layers"] == 1 and calls["layers_canonical"] >= 4
    else:
        assert calls == {"layers": 5}


@pytest.mark.parametrize("exact", [False, True])
def test_captured_features_and_uncovered_families(exact, calls):
    """A pass that captures hidden states runs one native call per stretch of layers up to a captured one
    (3 layers, features after layer 1 and the final norm: layers 0 and 1-2; same bits as the Python step);
    a family the C++ does not cover (Gemma 3: sandwich norms, q/k norms) runs the Python step."""
    model = tiny_llama(layers=3, hidden=64)
    ids = torch.randint(0, 32, (30,), generator=torch.Generator().manual_seed(4))
    got = {}
    for use in (False, True):
        r = FastRunner(model, capacity=64, exact=exact, native=use)
        r.forward(ids[:20], last_only=True, features=(1, 3))
        got[use] = tuple(r.forward(ids[20:25], features=(1, 3)))
    assert torch.equal(got[True][0], got[False][0]) and torch.equal(got[True][1], got[False][1])
    # two passes of two calls; exact mode's prefill of 20 positions is not a canonical pass
    want = {"layers": 2, "layers_canonical": 2} if exact else {"layers": 4}
    assert calls == want
    gemma = FastRunner(tiny_gemma3(), capacity=64, exact=False)
    assert gemma.net._native_layers(gemma.net.layers, gemma.net.linear) is None
    gemma.forward(ids[:10])
    assert calls == want


def test_a_replaced_linear_runs_the_python_step(monkeypatch):
    """A linear other than the kernels the C++ issues (a test planting another rounding) is not run natively."""
    real = quant.linear
    monkeypatch.setattr(quant, "linear", lambda x, w, b=None: real(x, w, b))
    r = FastRunner(tiny_llama(layers=2, hidden=64).to(torch.bfloat16), capacity=64, weights="q4")
    assert r.net.linear is quant.linear and r.net._native_layers(r.net.layers, r.net.linear) is None


@pytest.mark.parametrize("exact", [False, True])
def test_the_bf16_hybrid_of_cpus_without_bf16_instructions_runs_natively_with_the_same_bits(monkeypatch, exact, calls):
    """packed.py's hybrid (AVX2-only CPUs: bf16 weights for one row, widened float32 ones for more; forced
    here on any CPU) is a kind the C++ issues: passes of 1 row and of more equal the Python step's bits."""
    from verispec.fast import packed

    real = packed.available
    monkeypatch.setattr(packed, "available", lambda dtype, device: dtype != torch.bfloat16 and real(dtype, device))
    if not real(torch.float32, torch.device("cpu")):
        pytest.skip("no packed float32 weights here (oneDNN missing or VERISPEC_PACKED=0): no hybrid")
    model = tiny_llama(layers=3, hidden=64).to(torch.bfloat16)
    ids = torch.randint(0, 32, (60,), generator=torch.Generator().manual_seed(5))
    got = {}
    for use in (False, True):
        r = FastRunner(model, capacity=128, exact=exact, native=use)
        assert r.net.linear is packed._hybrid_linear
        got[use] = _passes(r, ids)
    assert r.net._native_layers(r.net.layers, r.net.linear) is not None
    assert torch.equal(got[True], got[False])
    assert calls.get("layers", 0) + calls.get("layers_canonical", 0) >= 4
