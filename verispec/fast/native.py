"""The layer step as one native call: core.layer_step's ATen operations issued from C++, not from Python.

Why. A decode step of a small model is a few hundred small operations; from Python each costs its
interpreter and binding overhead on top of the kernel (dev/native_step.py measures what this
saves). The C++ (verispec/csrc/native_step.cpp) issues THE SAME ATen operations in the same order with the same arguments as
core.layer_step (rms_norm -- norm.py's kernel where core.rms_norm calls it --, the projection kernels of
packed.py / quant.py, rope.py's rotation and cache write -- its kernel or the roll and index_copy_ --,
scaled_dot_product_attention, silu and the product -- glu.py's kernel where core.py calls it), so it
computes the same bits. One liberty: a layer's MLP residual is added by the next layer's input norm in
one call (norm.add_rms_norm, whose bits are the add's and then the norm's). core.layer_step stays the
reference and tests/test_native.py checks bit equality against it, in exact mode too (canonical.py's
attention, its operations likewise issued from C++). A pass is one native call for all layers (`layers`,
or `layers_canonical` in exact mode); a pass that captures hidden states (the drafters reading the
target's features) makes one such call per stretch of layers up to a captured one.

What it covers: the Llama-family step (no q/k norms, no sandwich norms, silu MLP) with projections that
are packed oneDNN weights, int4 / int8 weight-only ones (PyTorch's or qmm.py's) or plain ones
(F.linear), or packed.py's bf16 hybrid of AVX2 CPUs (F.linear at one row, the widened float32 copy at more);
anything else (Gemma 3, Qwen3) runs core.layer_step. The trained drafters' layers run the same way
(`eagle_run`: EagleDrafter._run; `dflash_blocks`: DFlashModel.blocks at inference), their Python
code the reference (tests/test_heads.py, tests/test_dflash.py check the bits). Built on first use by
ops.py's loader (a C++ compiler is needed; `python -m verispec.fast.build`, which setup.sh runs, builds it
ahead); where the build fails
or VERISPEC_NATIVE=0 the Python step runs, and `status()` says why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verispec.fast import glu, norm, ops, packed, quant, rope

# projection kinds (the C++ dispatches on them): how packed.py / quant.py store and apply a weight
PACKED, INT4, INT8, PLAIN, QMM, HYBRID = 0, 1, 2, 3, 4, 5


def _ready(mod) -> None:
    """Tell the loaded step which operators' kernels run, as the Python step decides."""
    mod.use_norm_kernel(norm.available() is None)  # as core.rms_norm decides (norm.runs_on)
    mod.use_rope_kernel(rope.available() is None)  # as rope.rotate_store decides (rope.runs_on)
    mod.use_glu_kernel(glu.available() is None)  # as glu.gated decides (glu.runs_on)


# a Python module built at -O2 without OpenMP (it issues ATen's operations; it has no loop of its own)
OPERATOR = ops.Operator("native step", "VERISPEC_NATIVE", "native_step.cpp", "the Python layer step runs",
                        lambda: ops.Flags(("-O2",)), registers=(), openmp=False, python_module=True, ready=_ready)


def module():
    """The built extension, or None (the reason in status())."""
    return OPERATOR.loaded()


def status() -> str:
    """'native' where the extension is in use, else why the Python step runs."""
    return OPERATOR.available() or "native"


# the functions whose kernels the C++ issues, as imported (a linear replaced later, e.g. by a test planting
# another rounding, is not one of them and runs the Python step)
_PACKED_LINEAR, _QUANT_LINEAR, _PLAIN_LINEAR, _HYBRID_LINEAR = packed._packed_linear, quant.linear, F.linear, packed._hybrid_linear


def kind_of(linear, w) -> tuple[int, torch.Tensor, torch.Tensor] | None:
    """(kind, w0, w1) of a projection weight as `linear` applies it, or None where the C++ has no such kind."""
    empty = torch.empty(0)
    if linear is _PACKED_LINEAR:
        return PACKED, w, empty
    if linear is _QUANT_LINEAR:
        if isinstance(w, quant.qmm.QWeight):
            return QMM, w.w, w.sc
        return (INT4, w.packed, w.sz) if isinstance(w, quant.Int4) else (INT8, w.q, w.scale)
    if linear is _PLAIN_LINEAR:
        return PLAIN, w, empty
    if linear is _HYBRID_LINEAR:
        return HYBRID, w[0], w[1]
    return None


def layer_args(arch, linear, lw: dict) -> tuple | None:
    """One layer's weights as the C++ takes them: (weights, kinds, bqkv, bo), or None where the step is
    not the Llama-family one or a projection kind is unknown (the Python step runs then)."""
    if arch.qk_norm or arch.sandwich or arch.gemma_norm or not glu.is_silu(arch.act):
        return None
    kinds, w = [], [lw["ln_attn"], lw["ln_mlp"]]
    for key in ("wqkv", "wo", "wgu", "wdown"):
        k = kind_of(linear, lw[key])
        if k is None:
            return None
        kinds.append(k[0])
        w += [k[1], k[2]]
    return w, kinds, lw.get("bqkv"), lw.get("bo")


def head_linears(module, pre: list[str], layers: list[str], post: list[str]) -> tuple | None:
    """A drafter head's linears as eagle_run / dflash_blocks take them: the linears `pre`, then per decoder
    layer (its name prefix in `layers`) its q/k/v, o, gate/up and down, then `post`, each as PackedLinears.lin /
    lins apply it (a group: one stacked copy, or each member) -> (kinds, weights, input dtypes, index of each
    layer's first linear, linears in each layer's q/k/v group, in its gate/up group), or None where a linear
    has a bias or a kind the C++ does not know (the Python operations run then)."""
    groups, firsts = list(pre), []
    for p in layers:
        firsts.append(len(groups))
        groups += [(p + "q", p + "k", p + "v"), p + "o", (p + "gate", p + "up"), p + "down"]
    groups += post
    kinds, ws, ins, counts = [], [], [], []
    packed = module._packed
    for entry in groups:
        if isinstance(entry, tuple) and (packed is None or entry not in packed):
            members = list(entry)
        else:
            members = [entry]
        for name in members:
            if packed is None:
                lin = module.get_submodule(name)
                if lin.bias is not None:
                    return None
                got, dtype = kind_of(_PLAIN_LINEAR, lin.weight), None
            else:
                w, linear, dtype, bias = packed[name]
                if bias is not None:
                    return None
                got = kind_of(linear, w)
            if got is None:
                return None
            kinds.append(got[0])
            ws += [got[1], got[2]]
            ins.append(None if dtype is None else torch.empty(0, dtype=dtype))
        counts.append(len(members))
    at = [sum(counts[:i]) for i in firsts]
    return kinds, ws, ins, at, [counts[i] for i in firsts], [counts[i + 2] for i in firsts]
