"""Training loops for the EAGLE head, the Medusa heads and the DFlash drafter, on features from extract.py.

Loss: cross-entropy of the head's distribution against the target's next-token distribution (its top-k,
renormalised over the tokens of the draft vocabulary), i.e. KL to the target up to a constant. No
feature regression: EAGLE-3 dropped it once the head drafts on its own outputs (training-time test).

EAGLE-3's training-time test (Li et al. 2025, section 3.3): the head is unrolled `ttt_steps` times on
its own outputs. Step 1 reads the target feature of every anchor position t and the token x_{t+1}, as
the committed entries at inference do; step j reads x_{t+j} and the head's own step j-1 output, sits at
position t + j - 1, and attends to the step-1 keys of positions <= t plus its own earlier steps of the
same anchor (a causal block and diagonals), which is exactly what a drafted chain sees at inference.
Step j's loss has weight 0.8^(j-1) and its label is the target's distribution at position t + j.

Medusa: head k (0-based) reads the target's final normed state at t and learns the distribution at
position t + k + 1; losses weighted 0.8^k.

DFlash drafter (drafters/dflash.py): random anchors inside the answers; at anchor t the
block [x_{t+1}, MASK...] sees the context entries of positions 0..t and slot i learns the target's
distribution at position t + i; slot i's loss has weight exp(-(i-1)/gamma) (dflash.position_weights).

Both loops log loss and top-1 agreement (the head's argmax equals the target's), checkpoint every
`save_every` steps with the optimizer and random state (resumable), and are seeded. The forward runs
under bfloat16 autocast where the CPU has native bf16 matrix units (AVX-512 BF16 / AMX), with float32
master weights and loss; a float32 GEMM there is far slower than a bf16 one (docs/performance-notes.md). Under torchrun they run
data-parallel with the same global batch (distributed.py): the per-step losses are normalised by the
label count of the whole global batch.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from verispec.train import distributed
from verispec.train.extract import FeatureSet


def soft_ce(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor, t2d: torch.Tensor,
            d2t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [..., Vd]; the target's top-k ids/probs [..., k] (target ids); mask [...] ->
    (summed loss, summed top-1 agreement, count)."""
    d = t2d[ids]  # [..., k] draft index or -1
    p = probs * (d >= 0)
    total = p.sum(-1)
    valid = mask & (total > 0)
    p = p / total.clamp_min(1e-9)[..., None]
    logp = logits.log_softmax(-1).gather(-1, d.clamp_min(0))
    loss = -(p * logp).sum(-1)
    agree = d2t[logits.argmax(-1)] == ids[..., 0]
    v = valid.float()
    return (loss * v).sum(), (agree.float() * v).sum(), v.sum()


def _manual_attention(q, keys, values, scores_mask, diag_k, diag_v):
    """q [B, nh, m, hd]; keys/values [B, nh, S, hd] with scores_mask [m, S]; diag_k/v lists of
    [B, nh, m, hd] (one key per query row: its own anchor's earlier unrolled steps)."""
    scale = q.shape[-1] ** -0.5
    s = (q @ keys.transpose(-1, -2)) * scale
    s = s.masked_fill(~scores_mask, float("-inf"))
    d = [((q * k).sum(-1, keepdim=True) * scale) for k in diag_k]
    w = torch.cat([s] + d, dim=-1).softmax(-1)
    S = keys.shape[2]
    out = w[..., :S] @ values
    for i, v in enumerate(diag_v):
        out = out + w[..., S + i: S + i + 1] * v
    return out


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, S, ...], idx [B, Q] -> x at those positions [B, Q, ...]."""
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


def eagle_unroll(head, tok, feats, steps: int, anchors: torch.Tensor | None = None):
    """The training-time-test forward. tok [B, S], feats [B, S, F]; anchors [B, Q] (absolute positions,
    default every position with a next token) -> list of logits per step j, each [B, Q, Vd]: step j at
    anchor t predicts the target's distribution at position t + j (label index t + j).

    Step 1 computes every layer's entries of every position < S - 1 (the keys: the whole prefix from
    position 0, as the drafter's caches hold at inference; a layer's keys read the layer before's output
    at every position) and the last layer's queries at the anchors only; deeper steps run at the anchors
    alone, each layer attending to its own keys. Anchors whose tokens run past S read clamped tokens;
    their labels must be masked."""
    B, S = tok.shape
    rep = head.n_heads // head.n_kv
    dev = tok.device
    m1 = S - 1
    L = head.num_layers
    if anchors is None:
        anchors = torch.arange(m1, device=dev).expand(B, m1)
    every = torch.arange(m1, device=dev)
    x = head.inputs(tok[:, 1:], head.project(feats[:, :-1]))  # entry t: token t + 1 with the feature of t
    visible = (every[None, None, :] <= anchors[:, :, None])[:, None]  # [B, 1, Q, m1]
    keys = []  # per layer: its keys and values of every position, one per query head
    for layer in range(L):
        q, k, v = head.qkv(x, every.expand(B, m1), layer)
        keys.append((k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
        if layer < L - 1:  # every position's output: the next layer's keys read it
            x = head.finish(x, _manual_attention(q, *keys[layer], every[None, :] <= every[:, None], [], []), layer)
        else:
            x = _rows(x, anchors)
            q = q.gather(2, anchors[:, None, :, None].expand(B, q.shape[1], anchors.shape[1], q.shape[3]))
            h = head.finish(x, _manual_attention(q, *keys[layer], visible, [], []), layer)
    out = [head.logits(h)]
    dk, dv = [[] for _ in range(L)], [[] for _ in range(L)]
    for j in range(2, steps + 1):
        x = head.inputs(_rows(tok, (anchors + j).clamp_max(S - 1)), h)  # token t + j with the step j-1 output
        for layer in range(L):
            q, k, v = head.qkv(x, anchors + (j - 1), layer)
            dk[layer].append(k.repeat_interleave(rep, 1))
            dv[layer].append(v.repeat_interleave(rep, 1))
            x = head.finish(x, _manual_attention(q, *keys[layer], visible, dk[layer], dv[layer]), layer)
        h = x
        out.append(head.logits(h))
    return out


def shifted_labels(batch: dict, shift: int):
    """The labels of anchor t + shift for every anchor: (ids [B, Q, k], probs [B, Q, k], mask [B, Q])."""
    S = batch["tokens"].shape[1]
    pos = batch["anchors"] + shift
    at = pos.clamp_max(S - 1)
    mask = batch["anchor_mask"] & (pos < S) & _rows(batch["label_mask"], at)
    return _rows(batch["topk_ids"], at), _rows(batch["topk_p"], at), mask


def _vocab_maps(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(d2t.numel())
    return t2d


class Trainer:
    """Shared loop: batches, AdamW with warm-up + cosine decay, logging, resumable checkpoints."""

    def __init__(self, module, data: FeatureSet, vocab: int, work: Path, steps: int, batch_size: int, seq_len: int,
                 lr: float, seed: int, device, log=print, save_every: int = 50, progress: bool = True,
                 max_seconds: float | None = None, autocast: str = "auto"):
        if batch_size < distributed.world():
            from verispec.errors import InvalidParameter

            raise InvalidParameter(f"batch-size {batch_size} leaves ranks without rows; use at least {distributed.world()}")
        self.module, self.data, self.work = module.to(device), data, Path(work)
        self.autocast = autocast_dtype(autocast, torch.device(device))
        self.steps, self.batch_size, self.seq_len, self.lr = steps, batch_size, seq_len, lr
        main = distributed.is_main()  # one rank speaks for all
        log = log if main else (lambda m: None)
        self.device, self.log, self.save_every, self.progress = torch.device(device), log, save_every, progress and main
        self.seed = seed
        # training-time cap over all runs of this training (a resumed run counts the time before it), so a
        # resumed run continues the same learning-rate schedule and stops where one long run would have
        self.max_seconds = max_seconds
        self.d2t = module.d2t.to(self.device)
        self.t2d = _vocab_maps(module.d2t.cpu(), vocab).to(self.device)
        params = [p for p in module.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.step = 0
        self.rng = torch.Generator().manual_seed(seed)
        self.history: list[dict] = []
        self.work.mkdir(parents=True, exist_ok=True)
        self.ckpt = self.work / "trainer.pt"
        if self.ckpt.exists():  # resume
            st = torch.load(self.ckpt, weights_only=False)
            module.load_state_dict(st["module"])
            self.opt.load_state_dict(st["opt"])
            self.step, self.history = st["step"], st["history"]
            self.rng.set_state(st["rng"])
            self.log(f"resumed at step {self.step}")

    def save(self) -> None:
        tmp = self.ckpt.with_suffix(".tmp")
        torch.save({"module": self.module.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "history": self.history, "rng": self.rng.get_state()}, tmp)
        tmp.replace(self.ckpt)

    def lr_at(self, step: int, time_share: float = 0.0) -> float:
        """Warm-up over the first 5% of steps, then cosine decay to 0 at `steps` or at the end of the time
        budget (time_share: the share of it used), whichever comes first."""
        warm = max(1, self.steps // 20)
        if step < warm:
            return self.lr * (step + 1) / warm
        done = max((step - warm) / max(1, self.steps - warm), min(1.0, time_share))
        return self.lr * 0.5 * (1 + math.cos(math.pi * done))

    def run(self, loss_fn) -> list[dict]:
        """loss_fn(batch dict on device, see FeatureSet.batch) -> (loss, per-step agreement list)."""
        torch.manual_seed(self.seed + self.step)
        step_fn = distributed.wrap(self.module, loss_fn)
        it = range(self.step, self.steps)
        if self.progress:
            from tqdm import tqdm

            it = tqdm(it, initial=self.step, total=self.steps, desc="train", unit="step")
        t0 = t_last = time.perf_counter()
        spent = self.history[-1]["seconds"] if self.history else 0.0  # in the runs this one resumes
        elapsed = spent
        if self.max_seconds is not None and spent > self.max_seconds:  # the same test as after a step
            self.log(f"time budget already spent at step {self.step}")
            it = range(0)
        for step in it:
            idx = torch.randint(0, len(self.data), (self.batch_size,), generator=self.rng).tolist()
            rows = distributed.my_rows(self.data.batch(idx, self.seq_len, self.rng))  # every rank draws the global batch
            batch = {name: t.to(self.device) for name, t in rows.items()}
            share = elapsed / self.max_seconds if self.max_seconds else 0.0
            for g in self.opt.param_groups:
                g["lr"] = self.lr_at(step, share)
            self.module.train()
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast is not None):
                loss, agree = step_fn(batch)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), 1.0)
            self.opt.step()
            self.step = step + 1
            done = self.history[-1]["seconds"] if self.history else 0.0
            whole = float(distributed.total(loss.detach())) / distributed.world()  # the global batch's loss
            rec = {"step": self.step, "loss": round(whole, 4), "top1": [round(a, 4) for a in agree],
                   "seconds": round(done + time.perf_counter() - t_last, 1)}
            t_last = time.perf_counter()
            self.history.append(rec)
            if self.progress:
                it.set_postfix(loss=f"{rec['loss']:.3f}", top1=f"{rec['top1'][0]:.3f}")
            if self.step % 10 == 0 or self.step == self.steps:
                self.log(json.dumps(rec))
            if self.max_seconds is not None:  # the ranks' mean clock: every rank anneals and stops at the same step
                elapsed = spent + float(distributed.total(torch.tensor(time.perf_counter() - t0, dtype=torch.float64))) / distributed.world()
            out_of_time = self.max_seconds is not None and elapsed > self.max_seconds
            if (self.step % self.save_every == 0 or self.step == self.steps or out_of_time) and distributed.is_main():
                self.save()
            if out_of_time:
                self.log(f"time budget reached after step {self.step}")
                break
        self.module.eval()
        return self.history


def autocast_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of the training forward: "auto" is bfloat16 on a GPU or on a CPU with native bf16
    matrix instructions, else none (float32); "bfloat16" / "float32" force it."""
    if choice not in ("auto", "bfloat16", "float32"):
        raise ValueError(f"unknown training precision {choice!r}; use auto, bfloat16 or float32")
    if choice == "auto":
        native = device.type != "cpu" or torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return torch.bfloat16 if native else None
    return torch.bfloat16 if choice == "bfloat16" else None


def train_eagle(head, data: FeatureSet, vocab: int, work: Path, steps: int = 200, batch_size: int = 8,
                seq_len: int = 192, lr: float = 1e-3, ttt_steps: int = 3, seed: int = 0, device="cpu", log=print,
                save_every: int = 50, progress: bool = True, max_seconds: float | None = None, autocast: str = "auto"):
    cols = data.columns(head.feature_layers, head.embed.shape[1]).to(device)
    head.embed = head.embed.to(device)
    trainer = Trainer(head, data, vocab, work, steps, batch_size, seq_len, lr, seed, device, log, save_every, progress,
                      max_seconds, autocast)

    def loss_fn(batch):
        outs = eagle_unroll(head, batch["tokens"], batch["feats"].index_select(-1, cols).float(), ttt_steps,
                            batch["anchors"])
        total, agree = 0.0, []
        for j, lg in enumerate(outs, start=1):
            s, a, n = soft_ce(lg, *shifted_labels(batch, j), trainer.t2d, trainer.d2t)
            a, n = distributed.total(a), distributed.total(n)  # the global batch's counts
            total = total + (0.8 ** (j - 1)) * s * distributed.world() / n.clamp_min(1)
            agree.append(float(a / n.clamp_min(1)))
        return total, agree

    return trainer.run(loss_fn)


def train_medusa(heads, data: FeatureSet, vocab: int, work: Path, steps: int = 200, batch_size: int = 8,
                 seq_len: int = 192, lr: float = 1e-3, seed: int = 0, device="cpu", log=print, save_every: int = 50,
                 progress: bool = True, max_seconds: float | None = None, autocast: str = "auto"):
    hidden = heads.lm_head.weight.shape[1]
    cols = data.columns(heads.feature_layers, hidden).to(device)
    trainer = Trainer(heads, data, vocab, work, steps, batch_size, seq_len, lr, seed, device, log, save_every, progress,
                      max_seconds, autocast)

    def loss_fn(batch):
        lg = heads(_rows(batch["feats"], batch["anchors"]).index_select(-1, cols).float())  # [B, Q, K, Vd]
        total, agree = 0.0, []
        for k in range(heads.num_heads):
            s, a, n = soft_ce(lg[:, :, k], *shifted_labels(batch, k + 1), trainer.t2d, trainer.d2t)
            a, n = distributed.total(a), distributed.total(n)
            total = total + (0.8 ** k) * s * distributed.world() / n.clamp_min(1)
            agree.append(float(a / n.clamp_min(1)))
        return total, agree

    return trainer.run(loss_fn)


def train_dflash(model, data: FeatureSet, vocab: int, work: Path, steps: int = 200, batch_size: int = 8,
                 seq_len: int = 192, lr: float = 1e-3, anchors: int = 16, gamma: float | None = None, seed: int = 0,
                 device="cpu", log=print, save_every: int = 50, progress: bool = True, max_seconds: float | None = None,
                 autocast: str = "auto"):
    """anchors: blocks per sequence and step, drawn at random among the window's `seq_len` anchors."""
    from verispec.drafters.dflash import block_logits_for_anchors, position_weights

    cols = data.columns(model.feature_layers, model.hidden).to(device)
    model.embed = model.embed.to(device)
    weights = position_weights(model.block_size, gamma)
    trainer = Trainer(model, data, vocab, work, steps, batch_size, seq_len, lr, seed, device, log, save_every, progress,
                      max_seconds, autocast)

    def loss_fn(batch):
        Q = batch["anchors"].shape[1]
        pick = torch.randperm(Q)[:anchors].sort().values.to(batch["anchors"].device)
        batch = {**batch, "anchors": batch["anchors"][:, pick], "anchor_mask": batch["anchor_mask"][:, pick]}
        lg = block_logits_for_anchors(model, batch["tokens"], batch["feats"].index_select(-1, cols).float(),
                                      batch["anchors"])
        total, agree = 0.0, []
        for i, w in enumerate(weights, start=1):
            s, a, n = soft_ce(lg[:, :, i - 1], *shifted_labels(batch, i), trainer.t2d, trainer.d2t)
            a, n = distributed.total(a), distributed.total(n)  # the global batch's counts
            total = total + w * s * distributed.world() / n.clamp_min(1)
            agree.append(float(a / n.clamp_min(1)))
        return total, agree

    return trainer.run(loss_fn)
