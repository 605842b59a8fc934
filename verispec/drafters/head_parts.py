"""The parts the drafters on the target's hidden features share (the EAGLE head, the Medusa heads, the
DFlash drafter): their layers, which target layers they read, the queue of features the engine hands
over, packed weight copies, loading, the draft-vocabulary side of choosing tokens (a chain's, and
tree children's for the tree builder, tree.build), and the drafting of heads whose every position has
one distribution (PositionDrafting: Medusa, DFlash).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from verispec.drafters.base import Drafter
from verispec.errors import HeadMismatch
from verispec.fast import norm, rope
from verispec.sampling import logits_to_probs, sample
from verispec.tree import Candidate, DynamicTree, StaticTree, build_tree, to_proposal
from verispec.types import Proposal, SamplingParams


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm.runs_on(x) and x.dtype == self.weight.dtype and not (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            # drafting: one kernel call for the half-dozen operations below (the same arithmetic, the sum of
            # squares in its own order); training keeps the operations, which autograd differentiates
            return norm.rms_norm(x, self.weight, self.eps)
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class DecoderLayer(nn.Module):
    """The parameters of a pre-norm Llama decoder layer (norms, attention projections, gated MLP); the
    module that holds it applies them (through its packed copies when drafting): the EAGLE head's layers
    after its first, the DFlash drafter's layers."""

    def __init__(self, H: int, n_heads: int, n_kv: int, head_dim: int, inter: int, eps: float = 1e-5):
        super().__init__()
        self.ln1, self.ln2 = RMSNorm(H, eps), RMSNorm(H, eps)
        self.q = nn.Linear(H, n_heads * head_dim, bias=False)
        self.k = nn.Linear(H, n_kv * head_dim, bias=False)
        self.v = nn.Linear(H, n_kv * head_dim, bias=False)
        self.o = nn.Linear(n_heads * head_dim, H, bias=False)
        self.gate = nn.Linear(H, inter, bias=False)
        self.up = nn.Linear(H, inter, bias=False)
        self.down = nn.Linear(inter, H, bias=False)

    def start_as_identity(self) -> None:
        """Zero the residual branches' outputs: the layer passes its input through unchanged."""
        with torch.no_grad():
            self.o.weight.zero_()
            self.down.weight.zero_()


def rotary(pos: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of positions pos [..., T] -> cos, sin [..., 1, T, hd] in dtype (sin's first half
    negated, so that rotation is x * cos + roll(x, hd / 2) * sin: fast/rope.py's form), for rotate."""
    freqs = pos.float()[..., None] * inv_freq  # [..., T, hd/2]
    cos, sin = freqs.cos(), freqs.sin()
    return (torch.cat([cos, cos], dim=-1).unsqueeze(-3).to(dtype),
            torch.cat([-sin, sin], dim=-1).unsqueeze(-3).to(dtype))


def rotate(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotary embedding of x [..., heads, T, hd] with the tables of its positions (rotary) -> same shape."""
    return rope.rotate(x, *tables)


def default_feature_layers(num_hidden_layers: int) -> list[int]:
    """Hidden-state indices (transformers' numbering: i = output of decoder layer i - 1) of a low, a
    middle and a high layer, the choice of EAGLE-3's reference code (layers 2, L/2, L-3)."""
    L = num_hidden_layers
    return sorted({min(3, L), max(1, L // 2 + 1), max(1, L - 2)})


class PackedLinears:
    """A module whose linear layers can run from packed weight copies."""

    _packed: dict | None = None  # name -> (inference copy of the weight, the linear that applies it, input dtype, bias)

    def stacks(self) -> tuple[tuple[str, ...], ...]:
        """Groups of sibling linears (their last name part) that read the same input: each gets one stacked
        copy (a decoder layer's q, k and v; gate and up)."""
        return (("q", "k", "v"), ("gate", "up"))

    def pack_for_inference(self, dtype: torch.dtype, quantized: bool = False) -> None:
        """Draft with copies of the linear weights in `dtype`, in oneDNN's layout on CPU (fast/packed.py).
        F.linear reads float32 weights far below the memory bandwidth on CPU, which made the weight reads
        most of an EAGLE step's drafting time. quantized (the target runs quantized weights): 8 bits per
        weight with a scale per output channel, on the target's quantized kernel where the format runs
        (fast/quant.py; half the bytes of bf16, and on CPUs without bf16 instructions ~5x faster than the
        bf16 copy); the verification keeps the output lossless whatever the head computes. The trained
        parameters are untouched (training and saving never see the copies); activations stay float32
        between the linears (qmm.py's 8-bit kernel reads them as they are; the other copies take them in
        `dtype`). Linears that read the same input (`stacks`) also get one copy of their weights stacked,
        so that `lins` applies them in one call (one pass over the input, one kernel call instead of
        several; per output channel the same arithmetic). Biases stay float32 and are added after."""
        from verispec.fast import quant, qmm
        from verispec.fast.packed import linear_for

        linears = {name: m for name, m in self.named_modules() if isinstance(m, nn.Linear)}
        first = next(iter(linears.values())).weight
        pack, lin = linear_for(dtype, first.device)
        eight = quantized and quant.available("q8", dtype, first.device) is None
        if not eight and lin is F.linear and dtype == first.dtype:
            self._packed = None
            return
        copies = {name: (m.weight.detach(), None if m.bias is None else m.bias.detach()) for name, m in linears.items()}
        for name in linears:
            stem, _, leaf = name.rpartition(".")
            for group in self.stacks():
                if leaf == group[0] and all(f"{stem}.{g}".lstrip(".") in linears for g in group):
                    names = tuple(f"{stem}.{g}".lstrip(".") for g in group)
                    biases = [copies[n][1] for n in names]
                    copies[names] = (torch.cat([copies[n][0] for n in names], dim=0),
                                     None if biases[0] is None else torch.cat(biases))
        self._packed = {}
        for name, (w, b) in copies.items():
            if eight:
                qw = quant.prepare(w.float(), "q8", dtype)
                # qmm takes float32 activations itself (its 8-bit groups round them): no copy in dtype first
                self._packed[name] = (qw, quant.linear, None if isinstance(qw, qmm.QWeight) else dtype, b)
            else:
                self._packed[name] = (pack(w.to(dtype)), lin, dtype, b)

    def lin(self, name, x: torch.Tensor) -> torch.Tensor:
        """The linear layer `name` (a submodule path) applied to x (the packed copy when there is one)."""
        if self._packed is None:
            return self.get_submodule(name)(x)
        w, linear, dtype, b = self._packed[name]
        flat = x.reshape(-1, x.shape[-1])
        out = linear(flat if dtype is None else flat.to(dtype), w).to(x.dtype)
        if b is not None:
            out = out + b
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def lins(self, names: tuple[str, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The linear layers `names` applied to the same x: one call on their stacked copy where
        pack_for_inference made one, else each layer."""
        if self._packed is None or names not in self._packed:
            return tuple(self.lin(n, x) for n in names)
        sizes = [self.get_submodule(n).out_features for n in names]
        return self.lin(names, x).split(sizes, dim=-1)


def load_module(target, kind: str, cls, head: str | Path | None = None, device=None, embed: bool = True):
    """The `kind` module at `head` (default: the one shipped for the target), checked against the target,
    in float32, with the target's embedding table attached when `embed` (EAGLE head, DFlash drafter)."""
    from verispec.heads import read_head, resolve_head

    path = resolve_head(target, kind, head)
    config, tensors = read_head(path, kind, target)
    module = cls(config)
    missing, unexpected = module.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()},
                                                 strict=False)
    if missing or unexpected:
        raise HeadMismatch(f"the {kind} head at '{path}' does not fit its config (missing {missing}, unexpected {unexpected})")
    if embed:
        module.attach_embedding(target.model.get_input_embeddings().weight)
    return module.to(device or target.device).eval()


class HeadDrafting(Drafter):
    """What the EAGLE, Medusa and DFlash drafters share: the draft vocabulary map, choosing a chain token,
    and scoring tree children (tree.build.Scorer)."""

    can_tree = True
    vocab: int
    d2t: torch.Tensor
    params: SamplingParams
    generator: torch.Generator | None

    def full_logits(self, lg: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [..., Vd] -> target-vocabulary logits [..., V] (-inf elsewhere)."""
        out = lg.new_full((*lg.shape[:-1], self.vocab), float("-inf"))
        out[..., self.d2t] = lg
        return out

    def q_of(self, lg: torch.Tensor) -> torch.Tensor:
        """The draft distribution over the target vocabulary, after the target's sampling transform."""
        return logits_to_probs(self.full_logits(lg.float()), self.params)

    def choose(self, lg: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """One chain token: argmax when greedy (no q needed), else a draw from q (and q)."""
        if self.params.greedy:
            return int(self.d2t[int(lg.argmax())]), None
        q = self.q_of(lg)
        return sample(q, self.generator), q

    def ranking(self, lg: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, Vd] -> the probabilities that rank point-mass tree children (a Scorer's)."""
        return lg.float().softmax(-1)


class PositionDrafting(HeadDrafting):
    """Drafters whose every draft position has one distribution, whatever was drafted before it (Medusa's
    heads, the DFlash drafter's MASK slots): `block_logits(context)` -> logits [K, Vd] of positions
    1..K after the pending token, or None. A chain takes each position's argmax or a draw from its q;
    a tree takes each position's top tokens as the children of every node at that depth."""

    def block_logits(self, context: list[int]) -> torch.Tensor | None:
        raise NotImplementedError

    @torch.inference_mode()
    def propose(self, context: list[int], k: int) -> Proposal | None:
        lg = self.block_logits(context)
        if lg is None or k < 1:
            return None
        tokens, probs = [], []
        for d in range(min(k, lg.shape[0])):
            x, q = self.choose(lg[d])
            tokens.append(x)
            probs.append(q)
        return Proposal(tokens=torch.tensor(tokens, dtype=torch.long),
                        draft_probs=None if self.params.greedy else torch.stack(probs))

    @torch.inference_mode()
    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        lg = self.block_logits(context)
        if lg is None:
            return None
        K = lg.shape[0]
        if isinstance(shape, StaticTree) and shape.depth > K:
            shape = shape.truncated(K)
        elif isinstance(shape, DynamicTree) and shape.depth > K:
            shape = replace(shape, depth=K)
        self._block = lg
        cands, keep = build_tree(self, shape, not self.params.greedy, self.generator)
        return to_proposal(cands, keep, vocab=self.vocab) if keep else None

    def feed(self, cands: list[Candidate], nodes: list[int]) -> None:
        pass  # a position's distribution does not depend on the drafted prefix

    def child_logits(self, cands: list[Candidate], nodes: list[int]) -> torch.Tensor:
        depth = cands[nodes[0]].depth if nodes[0] >= 0 else 0
        return self._block[depth].expand(len(nodes), -1)


class FeatureQueue:
    """Target features handed over by the engine (observe_features) and not yet turned into the drafter's
    cache entries; the EAGLE and DFlash drafters share it."""

    device: torch.device
    params: SamplingParams
    generator: torch.Generator | None

    def clear_features(self) -> None:
        self.features: list[torch.Tensor] = []  # not yet turned into entries
        self.n_features = 0                     # received so far (positions 0..n_features-1)

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.reset()
        self.params, self.generator = params, generator

    def observe_features(self, features: torch.Tensor) -> None:
        """Target features [m, F] of the next m committed positions (prefill, then each accepted path)."""
        self.features.append(features.to(self.device))
        self.n_features += int(features.shape[0])

    def take_features(self) -> torch.Tensor | None:
        """The queued features as one [m, F] tensor (the queue empties), or None when there are none."""
        if not self.features:
            return None
        feats = torch.cat(self.features, dim=0)
        self.features = []
        return feats
