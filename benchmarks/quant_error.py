"""Largest weight differences of the fast path's weights formats against a GGUF's own float32
dequantization (what transformers loads): q4 (the file's Q4_0/Q4_1 blocks on the int4 kernel), q8 (int8
per channel), and the dense bf16 copy for comparison; the LM head (Q8_0 in SmolLM2's file) as int8.

    .venv/bin/python benchmarks/quant_error.py --model smollm2-135m --json results/xeon/kernels/quant_error_smollm2-135m.json
"""

from __future__ import annotations

import sys

import torch
from _common import options, write_json


def main() -> None:
    ap = options(__doc__, model="smollm2-135m", json=None)
    args = ap.parse_args()

    from verispec.fast import quant
    from verispec.fast.core import projection_names
    from verispec.models import load_model

    target = load_model(args.model, dtype="bfloat16")
    src = target.weight_source
    if src is None:
        sys.exit(f"{args.model} was not loaded from a GGUF file")
    worst: dict[str, float] = {}

    def note(key: str, err: torch.Tensor) -> None:
        worst[key] = max(worst.get(key, 0.0), float(err.max()))

    for i in range(target.model.config.num_hidden_layers):
        for names in projection_names(i).values():
            for name in names:
                ref, got = src.dense(name), src(name)
                if isinstance(got, quant.Groups):
                    e = (quant.effective(quant.to_int4(got, torch.bfloat16), got) - ref).abs()
                    note("q4 (file blocks, int4)", e)
                    group_max = ref.abs().reshape(ref.shape[0], -1, quant.GROUP).amax(-1)
                    note("q4 relative to the group's largest |w|", e / group_max.repeat_interleave(quant.GROUP, 1).clamp_min(1e-30))
                else:
                    note("q4 (no 4-bit blocks: int8)", (quant.effective(quant.to_int8(ref, torch.bfloat16)) - ref).abs())
                note("q8 (int8 per channel)", (quant.effective(quant.to_int8(ref, torch.bfloat16)) - ref).abs())
                note("bf16 (dense)", (ref.bfloat16().float() - ref).abs())
                note("largest |w|", ref.abs())
    head = src.dense("lm_head.weight")
    note("LM head int8 (q4 and q8)", (quant.effective(quant.to_int8(head, torch.bfloat16)) - head).abs())
    note("LM head bf16", (head.bfloat16().float() - head).abs())
    for k, v in worst.items():
        print(f"{k:40s} {v:.6g}")
    if args.json:
        write_json({"model": args.model, "max_abs_difference": worst, "torch": torch.__version__}, args.json)


if __name__ == "__main__":
    main()
