"""Tree speculative sampling is lossless: the first 3 tokens are distributed exactly as the target's own
(temperature / top-k / top-p applied), for trees of point-mass candidates, of candidates sampled
independently from q (SpecInfer), sampled without replacement, and mixed kinds at mixed depths.

Target and draft are table models (next-token logits depend on the last two tokens, vocabulary 6), so
the exact distribution of 3 tokens is enumerated (216 sequences) and sampling is cheap. Each pure-rule
case draws N = 12,000 samples: a tree drawn by the draft, one call of tree_speculative_verify, then plain
target sampling to complete 3 tokens, compared by a chi-square test (joint and each position's marginal,
threshold p < 1e-4). Power: moving 1% of mass between the most and the least likely first token gives
the marginal test a noncentrality N * 0.01^2 * (1/p_hi + 1/p_lo), 45-290 for these cases against a
critical value of ~26 (5 degrees of freedom); each case asserts its power (scipy's noncentral
chi-square) is above 0.9, and test_power_* shows that this planted bias and a planted wrong rule
(skipping the residual update after a rejection) both fail the same test with the same N.
The engine is then checked end to end (tree forward, compaction, drafter protocol) with fewer samples.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from verispec import acceptance
from verispec.acceptance import tree_speculative_verify
from verispec.backends import Runner, Scores, TreeMask
from verispec.drafters.base import Drafter
from verispec.engine import Engine
from verispec.sampling import logits_to_probs
from verispec.tree import StaticTree, TreeLayout, parse_tree
from verispec.types import Proposal, SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")

V = 6
N = 12_000
ALPHA = 1e-4
PROMPT = [1, 2, 3, 1, 2]


class Table:
    """Next-token logits from the last two tokens; probabilities after a sampling transform, cached."""

    def __init__(self, seed: int, scale: float = 2.0):
        g = torch.Generator().manual_seed(seed)
        self.logits = torch.randn(V, V, V, generator=g) * scale
        self._probs: dict[SamplingParams, np.ndarray] = {}

    def probs(self, params: SamplingParams) -> np.ndarray:
        """float64 [V, V, V]: probs[a, b] = next-token distribution after tokens a, b."""
        key = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
        if key not in self._probs:
            probs = logits_to_probs(self.logits.reshape(V * V, V), key).reshape(V, V, V).double().numpy()
            self._probs[key] = probs / probs.sum(-1, keepdims=True)  # float32 round-off, for numpy's check
        return self._probs[key]

    def exact(self, prompt: list[int], params, n: int = 3) -> dict[tuple, float]:
        P = self.probs(params)
        out = {}
        for seq in itertools.product(range(V), repeat=n):
            ctx, prob = list(prompt), 1.0
            for t in seq:
                prob *= float(P[ctx[-2], ctx[-1], t])
                ctx.append(t)
            if prob > 0:
                out[seq] = prob
        return out


def shape_plan(paths) -> list[tuple[tuple[int, ...], int]]:
    """(node path, number of ranked children) for every node with children, parents first."""
    need = StaticTree(tuple(paths)).children_ranks()
    return sorted(need.items(), key=lambda kv: (len(kv[0]), kv[0]))


def draw_tree(context, plan, modes, Q: np.ndarray, rng: np.random.Generator):
    """A draft tree over a static shape; modes[d] says how the children at depth d + 1 are drawn:
    "point" (q's top tokens, point masses), "iid" (independent draws from q, rows = q) or "wor" (without
    replacement, rows = q without the earlier siblings). -> tokens, parents, q rows [n, V], and the
    context of every tree node (root first)."""
    where = {(): -1}
    tokens, parents, rows, ctx_of = [], [], [], {(): list(context)}
    for path, m in plan:
        if path not in where:
            continue
        ctx = ctx_of[path]
        q = Q[ctx[-2], ctx[-1]]
        mode = modes[len(path)]
        left = q.copy()
        order = np.argsort(-q, kind="stable")
        for r in range(m):
            if mode == "point":
                x = int(order[r])
                if q[x] == 0:
                    break
                row = np.zeros(V)
                row[x] = 1.0
            elif mode == "iid":
                x, row = int(rng.choice(V, p=q)), q
            else:
                if left.sum() <= 0:
                    break
                row = left / left.sum()
                x = int(rng.choice(V, p=row))
                left = left.copy()
                left[x] = 0
            child = path + (r,)
            where[child] = len(tokens)
            tokens.append(x)
            parents.append(where[path])
            rows.append(row)
            ctx_of[child] = ctx + [x]
    contexts = [ctx_of[p] for p in sorted(where, key=lambda p: where[p])]
    return tokens, parents, torch.from_numpy(np.stack(rows)).float(), contexts


def run_rule(target: Table, draft: Table, paths, modes, params, n: int, seed: int = 0) -> list[tuple]:
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    P, Q, plan = target.probs(params), draft.probs(params), shape_plan(paths)
    out = []
    for _ in range(n):
        tokens, parents, q, contexts = draw_tree(PROMPT, plan, modes, Q, rng)
        p = torch.from_numpy(np.stack([P[c[-2], c[-1]] for c in contexts])).float()  # row 0 = root
        res = tree_speculative_verify(torch.tensor(tokens), parents, q, p, gen)
        seq = PROMPT + list(res.tokens)
        while len(seq) < len(PROMPT) + 3:
            seq.append(int(rng.choice(V, p=P[seq[-2], seq[-1]])))
        out.append(tuple(seq[len(PROMPT): len(PROMPT) + 3]))
    return out


def chi_square_pvalue(samples: list[tuple], exact: dict[tuple, float]) -> float:
    """Chi-square goodness of fit; cells expecting fewer than 5 samples are pooled; an outcome of
    probability zero gives p = 0."""
    counts = Counter(samples)
    if any(k not in exact for k in counts):
        return 0.0
    n = len(samples)
    obs, exp, pool_o, pool_e = [], [], 0.0, 0.0
    for k in sorted(exact, key=lambda k: -exact[k]):
        if exact[k] * n >= 5:
            obs.append(counts.get(k, 0))
            exp.append(exact[k] * n)
        else:
            pool_o += counts.get(k, 0)
            pool_e += exact[k] * n
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    if len(obs) < 2:
        return 1.0
    exp_arr = np.array(exp) * (sum(obs) / sum(exp))
    return float(stats.chisquare(np.array(obs, float), exp_arr).pvalue)


def marginals(samples, exact, i):
    marg: dict[tuple, float] = {}
    for k, p in exact.items():
        marg[(k[i],)] = marg.get((k[i],), 0.0) + p
    return [(x[i],) for x in samples], marg


def shift_mass(exact: dict[tuple, float], amount: float = 0.01) -> dict[tuple, float]:
    """`amount` of probability moved from the most to the least likely first token."""
    first: dict[int, float] = {}
    for k, p in exact.items():
        first[k[0]] = first.get(k[0], 0.0) + p
    hi, lo = max(first, key=first.get), min(first, key=first.get)
    scale = {hi: 1 - amount / first[hi], lo: 1 + amount / first[lo]}
    return {k: p * scale.get(k[0], 1.0) for k, p in exact.items()}


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
    "without_replacement": (9, WIDE, ["wor"] * 3, dict(temperature=1.0, top_p=0.97)),
    "mixed_kinds_and_depths": (10, MIXED, ["iid", "point", "wor", "point"], dict(temperature=0.9, top_k=5, top_p=0.99)),
    "p_equals_q": (None, WIDE, ["iid"] * 3, dict(temperature=0.7)),
}


def _setup(case):
    seed, paths, modes, kw = CASES[case]
    target = Table(0)
    draft = target if seed is None else Table(seed, scale=1.5)
    params = SamplingParams(**kw)
    return target, draft, paths, modes, params


def shift_power(exact: dict[tuple, float], n: int, amount: float = 0.01) -> float:
    """Probability that the first-token marginal test rejects at ALPHA when `amount` of mass moves from
    the most to the least likely first token: noncentral chi-square with
    lambda = n * amount^2 * (1/p_hi + 1/p_lo)."""
    first: dict[int, float] = {}
    for k, p in exact.items():
        first[k[0]] = first.get(k[0], 0.0) + p
    df = len(first) - 1
    lam = n * amount ** 2 * (1 / max(first.values()) + 1 / min(first.values()))
    return float(stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, lam))


@pytest.mark.parametrize("case", list(CASES))
def test_rule_first_three_tokens_match_target(case):
    target, draft, paths, modes, params = _setup(case)
    exact = target.exact(PROMPT, params)
    assert shift_power(exact, N) > 0.9  # N is large enough to see a 1% shift in this case
    samples = run_rule(target, draft, paths, modes, params, N)
    check(samples, exact)


def test_p_equals_q_always_accepts_the_first_child():
    target, draft, paths, modes, params = _setup("p_equals_q")
    gen, rng = torch.Generator().manual_seed(1), np.random.default_rng(1)
    P = target.probs(params)
    for _ in range(200):
        tokens, parents, q, contexts = draw_tree(PROMPT, shape_plan(paths), modes, draft.probs(params), rng)
        p = torch.from_numpy(np.stack([P[c[-2], c[-1]] for c in contexts])).float()
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
    monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    target, draft, paths, modes, params = _setup(case)
    samples = run_rule(target, draft, paths, modes, params, N, seed=4)
    assert fails(samples, target.exact(PROMPT, params))


# ---- end to end through the Engine: a table "model" that verifies trees, and a drafter that makes them


class TableRunner(Runner):
    """The runner interface (forward with a tree, rollback, commit) over a Table: each slot remembers
    the token before it, so tree nodes read their own parent's token, not their slot neighbour's."""

    def __init__(self, table: Table):
        self.table, self.tokens, self.prev = table, [], []

    @property
    def length(self):
        return len(self.tokens)

    def reset(self, params=None):
        self.tokens, self.prev = [], []

    def _append(self, tok, prev):
        self.tokens.append(int(tok))
        self.prev.append(prev)
        return self.table.logits[self.tokens[prev] if prev >= 0 else 0, int(tok)]

    def forward(self, ids, tree=None, *, last_only=False, features=()):
        ids = ids.tolist() if torch.is_tensor(ids) else list(ids)
        if tree is None:
            out = torch.stack([self._append(t, self.length - 1) for t in ids])
            return Scores(out[-1:] if last_only else out)
        base, out = self.length, []
        for i, t in enumerate(ids):
            anc = [j for j in range(i) if tree.mask[i, j]]
            out.append(self._append(t, base + anc[-1] if anc else base - 1))
        return Scores(torch.stack(out))

    def check_tree_support(self):
        pass

    def rollback(self, length):
        del self.tokens[length:], self.prev[length:]

    def commit(self, start, keep):
        kept = [self.tokens[start + k] for k in keep]
        self.rollback(start)
        for t in kept:
            self.tokens.append(t)
            self.prev.append(self.length - 2)


class TableTreeDrafter(Drafter):
    name = "table-tree"
    can_tree = True

    def __init__(self, draft: Table, modes):
        self.draft, self.modes = draft, modes

    def begin(self, prompt, params, generator):
        self.Q = self.draft.probs(params)
        self.rng = np.random.default_rng(int(torch.randint(1 << 30, (1,), generator=generator)))

    def propose(self, context, k):
        raise AssertionError("the engine must ask for a tree")

    def propose_tree(self, context, shape):
        tokens, parents, q, _ = draw_tree(context, shape_plan(shape.paths), self.modes, self.Q, self.rng)
        return Proposal(torch.tensor(tokens), q, parents)

    def observe(self, result):
        pass


E2E_SAMPLES = 2500  # a smoke test of the wiring (no power claim); the rule itself is tested above


@pytest.mark.parametrize("case", ["mixed_kinds_and_depths"])
def test_engine_end_to_end(case):
    target, draft, paths, modes, params = _setup(case)
    engine = Engine(TableRunner(target), set(), lambda ids: "", 1000, drafter=TableTreeDrafter(draft, modes),
                    tree=parse_tree(paths))
    samples = []
    for i in range(E2E_SAMPLES):
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
    out = r.forward([4, 5, 0, 1], tree=TreeMask(lay.mask, lay.depths)).logits
    assert torch.equal(out[2], t.logits[4, 0]) and torch.equal(out[3], t.logits[0, 1]) and torch.equal(out[0], t.logits[3, 4])
