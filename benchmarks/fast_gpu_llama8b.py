"""GPU: an 8B-class Llama with random weights (no download) on the fast path, against its bandwidth floor.

Measures plain decoding (tok/s and ms per forward) against the floor set by reading every weight once
per token (weight bytes / measured device copy bandwidth), and the cost of verifying a 64-node tree in
one forward against one token. Random weights decode nonsense, but every kernel and byte moved is that
of a real Llama-3-8B-shaped model (hidden 4096, 32 layers, 32 heads / 8 KV heads, MLP 14336, vocab 128256).

    python -m benchmarks.fast_gpu_llama8b                 # on a CUDA GPU, bfloat16
    python -m benchmarks.fast_gpu_llama8b --compile       # torch.compile'd layer steps
    python -m benchmarks.fast_gpu_llama8b --dry-run       # CPU-sized model, checks the script end to end
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def build(dry: bool, device: str, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    if dry:
        cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=448, num_hidden_layers=4,
                          num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                          rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype).eval()
    with torch.no_grad():  # random weights at a sane scale (to_empty leaves garbage, maybe NaN)
        g = torch.Generator(device=device).manual_seed(0)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
        model.model.rotary_emb.__init__(cfg)  # meta-initialised buffers: recompute the rope tables
        model.model.rotary_emb.to(device)
    return model


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, repeat: int) -> float:
    fn()
    sync(device)
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def copy_bandwidth(device: str) -> float:
    src = torch.empty(1 << 30 if device.startswith("cuda") else 1 << 26, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src), device, 5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU-sized model on the CPU: checks the script only")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args()

    from verispec.backends import TreeMask
    from verispec.backends.fast import FastRunner

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    if device == "cpu" and not args.dry_run:
        raise SystemExit("no CUDA GPU here; use --dry-run to check the script on the CPU")
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build(args.dry_run, device, dtype)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bw = copy_bandwidth(device)
    floor_ms = weight_bytes / bw * 1e3
    print(f"{device} {dtype}: {weight_bytes / 1e9:.2f} GB of weights, copy bandwidth {bw / 1e9:.0f} GB/s, "
          f"floor {floor_ms:.2f} ms/token ({1e3 / floor_ms:.0f} tok/s)")

    runner = FastRunner(model, capacity=args.context + args.tokens + args.nodes + 64, exact=False,
                        compile=args.compile, buckets=(1, 2, 4, 8, 16, 32, 64, 128))
    vocab = model.config.vocab_size
    context = torch.randint(0, vocab, (args.context,)).tolist()

    # plain decoding: one token per forward, argmax fed back (no host sync inside a step)
    runner.reset()
    logits = runner.forward(context, last_only=True).logits
    tok = logits.argmax(-1)
    runner.forward(tok)  # warm the 1-token shape
    sync(device)
    t = time.perf_counter()
    for _ in range(args.tokens):
        tok = runner.forward(tok).logits[-1:].argmax(-1)
    sync(device)
    per_token = (time.perf_counter() - t) / args.tokens
    print(f"plain decoding: {per_token * 1e3:.2f} ms/token ({1 / per_token:.0f} tok/s), "
          f"{per_token * 1e3 / floor_ms:.2f}x the bandwidth floor")

    # tree verification: a 64-node tree (a binary-ish tree, depth ~6) against one token
    n = args.nodes
    parents = [-1] + [(i - 1) // 2 for i in range(1, n)]
    anc = torch.zeros(n, n, dtype=torch.bool)
    depths = torch.zeros(n, dtype=torch.long)
    for i, p in enumerate(parents):
        anc[i, i] = True
        while p >= 0:
            anc[i, p] = True
            depths[i] += 1
            p = parents[p]
    runner.reset()
    runner.forward(context, last_only=True)
    base = runner.length
    ids = torch.randint(0, vocab, (n,))

    def one_token():
        runner.forward(ids[:1])
        runner.rollback(base)

    def tree():
        runner.forward(ids, tree=TreeMask(anc, depths))
        runner.rollback(base)

    t1 = timed(one_token, device, args.repeat)
    tn = timed(tree, device, args.repeat)
    print(f"verify: 1 token {t1 * 1e3:.2f} ms, {n}-node tree {tn * 1e3:.2f} ms ({tn / t1:.2f}x)")


if __name__ == "__main__":
    main()
