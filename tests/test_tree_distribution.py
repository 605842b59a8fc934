"""Tree speculative sampling is lossless: the first 3 tokens are distributed exactly as the target's own
(temperature / top-k / top-p applied), for trees of point-mass candidates, of candidates sampled
independently from q (SpecInfer), sampled without replacement, and mixed kinds at mixed depths.

Target and draft are table models (next-token logits depend on the last two tokens, vocabulary 6), so
the exact distribution of 3 tokens is enumerated (216 sequences) and sampling is cheap. Each pure-rule
case draws N = 20,000 samples: a tree drawn by the draft, one call of tree_speculative_verify, then plain
target sampling to complete 3 tokens, compared by a chi-square test (joint and each position's marginal,
threshold p < 1e-4). Power: moving 1% of mass between the most and the least likely first token gives
a noncentrality N * 0.01^2 * (1/p_hi + 1/p_lo), about 45 here (p_lo ~ 0.025) against a critical value of
~23 for the marginal's 5 degrees of freedom; test_power_* shows that this planted bias and a planted
wrong rule (skipping the residual update after a rejection) both fail the same test with the same N.
The engine is then checked end to end (forward_tree, compaction, drafter protocol) with fewer samples.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from stats_util import chi_square_pvalue, marginals, shift_mass
from verispec import tree_acceptance
from verispec.engine import Engine
from verispec.sampling import logits_to_probs
from verispec.tree import StaticTree, TreeLayout, parse_tree
from verispec.tree_acceptance import tree_speculative_verify
from verispec.types import Proposal, SamplingParams

V = 6
N = 20_000
ALPHA = 1e-4
PROMPT = [1, 2, 3, 1, 2]


class Table:
    """Next-token logits from the last two tokens; probs[a, b] after a sampling transform, cached."""

    def __init__(self, seed: int, scale: float = 2.0):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(V, V, V, generator=g) * scale
        self._probs: dict[SamplingParams, torch.Tensor] = {}

    def probs(self, params: SamplingParams) -> torch.Tensor:
        key = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if key not in self._probs:
            self._probs[key] = logits_to_probs(self.logits.reshape(V * V, V), key).reshape(V, V, V)
        return self._probs[key]

    def p(self, context: list[int], params) -> torch.Tensor:
        return self.probs(params)[context[-2], context[-1]]

    def exact(self, prompt: list[int], params, n: int = 3) -> dict[tuple, float]:
        out = {}
        for seq in itertools.product(range(V), repeat=n):
            ctx, prob = list(prompt), 1.0
            for t in seq:
                prob *= float(self.p(ctx, params)[t])
                ctx.append(t)
            if prob > 0:
                out[seq] = prob
        return out


def draw_tree(context, paths, modes, draft: Table, params, gen):
    """A draft tree over the static shape `paths`; modes[d] says how the children at depth d + 1 are
    drawn: "point" (q's top tokens, point masses), "iid" (independent draws from q, rows = q) or "wor"
    (without replacement, rows = q without the earlier siblings). -> tokens, parents, q rows [n, V]."""
    need = StaticTree(tuple(paths)).children_ranks()
    where = {(): -1}
    tokens, parents, rows, ctx_of = [], [], [], {(): list(context)}
    for path in sorted(need, key=lambda p: (len(p), p)):
        if path not in where:
            continue
        q = draft.p(ctx_of[path], params)
        mode = modes[len(path)]
        left = q.clone()
        order = torch.argsort(q, descending=True, stable=True).tolist()
        for r in range(need[path]):
            if mode == "point":
                x = order[r]
                if q[x] == 0:
                    break
                row = torch.nn.functional.one_hot(torch.tensor(x), V).float()
            elif mode == "iid":
                x, row = int(torch.multinomial(q, 1, generator=gen)), q
            else:
                if left.sum() <= 0:
                    break
                row = left / left.sum()
                x = int(torch.multinomial(row, 1, generator=gen))
                left = left.clone()
                left[x] = 0
            child = path + (r,)
            where[child] = len(tokens)
            tokens.append(x)
            parents.append(where[path])
            rows.append(row)
            ctx_of[child] = ctx_of[path] + [x]
    return tokens, parents, torch.stack(rows), [ctx_of[p] for p in sorted(where, key=lambda p: where[p])]


def run_rule(target: Table, draft: Table, paths, modes, params, n: int, seed: int = 0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens, parents, q, contexts = draw_tree(PROMPT, paths, modes, draft, params, gen)
        p = torch.stack([target.p(c, params) for c in contexts])  # row 0 = root context
        res = tree_speculative_verify(torch.tensor(tokens), parents, q, p, gen)
        seq = list(res.tokens)
        while len(seq) < 3:
            seq.append(int(torch.multinomial(target.p(PROMPT + seq, params), 1, generator=gen)))
        out.append(tuple(seq[:3]))
    return out


def pvalues(samples, exact):
    return chi_square_pvalue(samples, exact), [chi_square_pvalue(*marginals(samples, exact, i)) for i in range(3)]


def check(samples, exact):
    joint, marg = pvalues(samples, exact)
    assert joint > ALPHA and min(marg) > ALPHA, f"joint p={joint:.2e}, marginals {[f'{p:.2e}' for p in marg]}"


def fails(samples, exact) -> bool:
    joint, marg = pvalues(samples, exact)
    return min([joint] + marg) < ALPHA


WIDE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
MIXED = [(0,), (1,), (0, 0), (0, 0, 0), (0, 0, 1), (1, 0), (1, 0, 0), (1, 0, 0, 0)]
CASES = {
    # name: (draft seed (None = the target itself), paths, modes by depth, sampling)
    "point_masses": (7, WIDE, ["point"] * 3, dict(temperature=1.0)),
    "iid_specinfer": (8, WIDE, ["iid"] * 3, dict(temperature=0.8, top_k=4)),
    "without_replacement": (9, WIDE, ["wor"] * 3, dict(temperature=1.0, top_p=0.9)),
    "mixed_kinds_and_depths": (10, MIXED, ["iid", "point", "wor", "point"], dict(temperature=1.2, top_k=5, top_p=0.95)),
    "p_equals_q": (None, WIDE, ["iid"] * 3, dict(temperature=0.7)),
}


def _setup(case):
    seed, paths, modes, kw = CASES[case]
    target = Table(0)
    draft = target if seed is None else Table(seed, scale=1.5)
    params = SamplingParams(**kw)
    return target, draft, paths, modes, params


@pytest.mark.parametrize("case", list(CASES))
def test_rule_first_three_tokens_match_target(case):
    target, draft, paths, modes, params = _setup(case)
    samples = run_rule(target, draft, paths, modes, params, N)
    check(samples, target.exact(PROMPT, params))


def test_p_equals_q_always_accepts_the_first_child():
    target, draft, paths, modes, params = _setup("p_equals_q")
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens, parents, q, contexts = draw_tree(PROMPT, paths, modes, draft, params, gen)
        p = torch.stack([target.p(c, params) for c in contexts])
        res = tree_speculative_verify(torch.tensor(tokens), parents, q, p, gen)
        assert res.accepted_nodes[:1] == [0] and res.num_accepted == 3  # rank 0 at every depth of WIDE


def test_power_planted_bias_fails():
    target, draft, paths, modes, params = _setup("point_masses")
    samples = run_rule(target, draft, paths, modes, params, N, seed=3)
    exact = target.exact(PROMPT, params)
    check(samples, exact)
    assert fails(samples, shift_mass(exact, 0.01))


@pytest.mark.parametrize("case", ["point_masses", "iid_specinfer"])
def test_power_rule_without_residual_update_fails(case, monkeypatch):
    monkeypatch.setattr(tree_acceptance, "_residual", lambda p, q: p)
    target, draft, paths, modes, params = _setup(case)
    samples = run_rule(target, draft, paths, modes, params, N, seed=4)
    assert fails(samples, target.exact(PROMPT, params))


# ---- end to end through the Engine: a table "model" that verifies trees, and a drafter that makes them


class TableRunner:
    """The runner interface (forward, forward_tree, crop, compact) over a Table: each slot remembers
    the token before it, so tree nodes read their own parent's token, not their slot neighbour's."""

    def __init__(self, table: Table):
        self.table, self.tokens, self.prev = table, [], []

    @property
    def length(self):
        return len(self.tokens)

    def reset(self):
        self.tokens, self.prev = [], []

    def _append(self, tok, prev):
        self.tokens.append(int(tok))
        self.prev.append(prev)
        return self.table.logits[self.tokens[prev] if prev >= 0 else 0, int(tok)]

    def forward(self, ids, last_only=False):
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        out = torch.stack([self._append(t, self.length - 1) for t in ids])
        return out[-1:] if last_only else out

    def forward_tree(self, ids, ancestor_mask, depths):
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        base, out = self.length, []
        for i, t in enumerate(ids):
            anc = [j for j in range(i) if ancestor_mask[i, j]]
            out.append(self._append(t, base + anc[-1] if anc else base - 1))
        return torch.stack(out)

    def crop(self, length):
        del self.tokens[length:], self.prev[length:]

    def compact(self, start, keep):
        kept = [self.tokens[start + k] for k in keep]
        self.crop(start)
        for t in kept:
            self.tokens.append(t)
            self.prev.append(self.length - 2)


class TableTreeDrafter:
    name = "table-tree"

    def __init__(self, draft: Table, modes):
        self.draft, self.modes = draft, modes

    def begin(self, prompt, params, generator):
        self.params, self.gen = params, generator

    def propose(self, context, k):
        raise AssertionError("the engine must ask for a tree")

    def propose_tree(self, context, shape):
        tokens, parents, q, _ = draw_tree(context, shape.paths, self.modes, self.draft, self.params, self.gen)
        return Proposal(torch.tensor(tokens), q, parents)

    def observe(self, result):
        pass


@pytest.mark.parametrize("case", ["iid_specinfer", "mixed_kinds_and_depths"])
def test_engine_end_to_end(case):
    target, draft, paths, modes, params = _setup(case)
    engine = Engine(TableRunner(target), set(), lambda ids: "", 1000, drafter=TableTreeDrafter(draft, modes),
                    tree=parse_tree(paths))
    samples = []
    for i in range(4000):
        g = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=i, temperature=params.temperature,
                                                   top_k=params.top_k, top_p=params.top_p))
        samples.append(tuple(g.token_ids))
    check(samples, target.exact(PROMPT, params))
    assert engine.last.stats.tree_steps >= 1


def test_table_runner_matches_tree_semantics():
    """The test runner itself: a node's logits come from its own parent's token."""
    t = Table(0)
    r = TableRunner(t)
    r.forward([1, 2, 3])
    lay = TreeLayout.from_parents([-1, 0, 0, 2])
    out = r.forward_tree([4, 5, 0, 1], lay.mask, lay.depths)
    assert torch.equal(out[2], t.logits[4, 0]) and torch.equal(out[3], t.logits[0, 1]) and torch.equal(out[0], t.logits[3, 4])
