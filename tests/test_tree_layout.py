"""Tree layouts and shapes: masks, depths, retrieve indices, static tree specs, dynamic selection,
greedy tree walks, and the hardware-aware budget choice, as pure functions."""

from __future__ import annotations

import pytest
import torch

from verispec.errors import InvalidParameter
from verispec.metrics import SpecStats
from verispec.tree import (STATIC_TREES, Candidate, DynamicTree, RankAcceptance, StaticTree, TreeLayout,
                           choose_budget, expected_accepted, optimal_paths, parse_tree, select_best, to_proposal)
from verispec.acceptance import greedy_tree_verify


pytestmark = pytest.mark.usefixtures("one_thread")

#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#   |
#   6
PARENTS = [-1, 0, 0, 1, 1, 2, 3]


def test_layout_mask_depths_retrieve():
    lay = TreeLayout.from_parents(PARENTS)
    assert lay.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    expected_rows = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 4}, 5: {0, 2, 5}, 6: {0, 1, 3, 6}}
    for i, row in expected_rows.items():
        assert set(lay.mask[i].nonzero().flatten().tolist()) == row
    assert lay.retrieve.tolist() == [[0, 1, 4, -1], [0, 2, 5, -1], [0, 1, 3, 6]]
    assert lay.children == [[1, 2], [3, 4], [5], [6], [], [], []]


def test_chain_is_a_tree():
    lay = TreeLayout.for_proposal(None, 4)
    assert lay.parents == [-1, 0, 1, 2, 3]
    assert torch.equal(lay.mask, torch.tril(torch.ones(5, 5, dtype=torch.bool)))
    assert lay.depths.tolist() == [0, 1, 2, 3, 4]


def test_bad_parents_rejected():
    with pytest.raises(InvalidParameter):
        TreeLayout.from_parents([-1, 2, 0])
    with pytest.raises(InvalidParameter):
        TreeLayout.for_proposal([-1, 0], 3)


def test_greedy_walk_follows_argmax_and_ends_with_target_token():
    # proposal nodes (proposal index: token, parent): 0:(5,-1) 1:(7,-1) 2:(3,1) 3:(4,1) 4:(9,3)
    tokens = torch.tensor([5, 7, 3, 4, 9])
    parents = [-1, -1, 1, 1, 3]
    logits = torch.full((6, 10), -5.0)
    for row, best in enumerate([7, 1, 4, 0, 9, 2]):  # root->7 (node1) ->4 (node3) ->9 (node4) ->2
        logits[row, best] = 5.0
    res = greedy_tree_verify(tokens, parents, logits)
    assert res.accepted_nodes == [1, 3, 4] and res.tokens == [7, 4, 9, 2]
    assert res.num_accepted == 3 and res.num_drafted == 5 and res.kinds()[-1] == "bonus"
    logits[4, 9], logits[4, 6] = -5.0, 5.0  # node 3 now wants 6: its child 9 is rejected
    res = greedy_tree_verify(tokens, parents, logits)
    assert res.tokens == [7, 4, 6] and res.kinds() == ["accepted", "accepted", "recovered"]


def test_optimal_paths_are_closed_and_maximal():
    a = [0.6, 0.2, 0.1]
    paths = optimal_paths(a, 10)
    have = set(paths)
    assert len(paths) == 10
    for p in paths:
        assert len(p) == 1 or p[:-1] in have  # ancestors present
        assert p[-1] == 0 or p[:-1] + (p[-1] - 1,) in have  # better siblings present
    # no 10-node tree does better: the 10 most probable of all paths up to depth 8, by brute force
    best = expected_accepted(a, paths)
    assert best == pytest.approx(sum(sorted([expected_accepted(a, [p]) for p in _all_paths(len(a), 8)], reverse=True)[:10]))


def _all_paths(ranks: int, depth: int) -> list[tuple[int, ...]]:
    level, out = [()], []
    for _ in range(depth):
        level = [p + (r,) for p in level for r in range(ranks)]
        out += level
    return out


def test_static_tree_defaults_and_parse():
    for name, paths in STATIC_TREES.items():
        StaticTree(tuple(paths))  # valid: every prefix present
    assert len(STATIC_TREES["medium"]) == 16
    t = parse_tree("static:small")
    assert isinstance(t, StaticTree) and len(t.paths) == 8
    assert parse_tree("static:[[0],[1],[0,0]]").paths == ((0,), (1,), (0, 0))
    assert parse_tree([[0], [0, 0], [0, 0, 0]], depth=2).paths == ((0,), (0, 0))
    d = parse_tree("dynamic", budget="auto", topk=3, depth=5)
    assert d == DynamicTree(budget=None, topk=3, depth=5)
    assert parse_tree(None) is None and parse_tree("none") is None
    for bad in ("static:nosuch", "weird:1", "static:[[0],[1,0]]", "static:[[0]", [[-1]]):
        with pytest.raises(InvalidParameter):
            parse_tree(bad)
    with pytest.raises(InvalidParameter):
        parse_tree("static:small", budget=8)
    with pytest.raises(InvalidParameter):
        parse_tree("dynamic", budget="many")


def test_select_best_keeps_ancestors_and_budget():
    c = [Candidate(1, -1, 0.5), Candidate(2, -1, 0.3), Candidate(3, 0, 0.45), Candidate(4, 2, 0.4), Candidate(5, 1, 0.01)]
    assert select_best(c, 3) == [0, 2, 3]
    assert select_best(c, 4) == [0, 1, 2, 3]
    prop = to_proposal(c, [0, 2, 3])
    assert prop.tokens.tolist() == [1, 3, 4] and prop.parents == [-1, 0, 1] and prop.draft_probs is None
    c[1].q = torch.tensor([0.1, 0.2, 0.7])
    prop = to_proposal(c, [0, 1])
    assert prop.draft_probs.tolist() == [[0.0, 1.0, 0.0], pytest.approx([0.1, 0.2, 0.7])]  # point mass = one-hot


def test_choose_budget_follows_the_cost_curve():
    a = [0.7, 0.1, 0.05]
    flat = {1: 1.0, 128: 1.0}              # verification free: bigger trees always help
    steep = {1: 1.0, 2: 2.0, 128: 128.0}   # cost proportional to nodes: the smallest tree wins
    assert choose_budget(a, flat).budget == 63
    assert choose_budget(a, steep).budget == 1
    knee = {1: 1.0, 8: 1.05, 16: 1.1, 32: 2.0, 64: 4.0}  # free up to ~16 positions, like a CPU roofline
    choice = choose_budget(a, knee)
    assert 6 <= choice.budget <= 16
    assert max(r[3] for r in choice.table) == next(r[3] for r in choice.table if r[0] == choice.budget)
    # exact mode pads every pass to 8 positions: up to 8 cost one pass, 9-16 two (a staircase)
    stairs = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 2.0, 32: 4.0, 64: 8.0}
    assert choose_budget(a, stairs).budget == 7  # root + 7 nodes fill one pass exactly
    assert parse_tree("dynamic") == DynamicTree(budget=None)  # auto unless a budget is given
    # budget 0, a plain step: one token for one position, no drafting
    gentle = {1: 1.0, 2: 1.2, 4: 1.6, 8: 2.4}
    assert choose_budget([0.3], gentle, (0, 1, 3)).budget == 1  # 1.3 tokens in 1.2 beat 1 in 1
    choice = choose_budget([0.3], gentle, (0, 1, 3), draft_cost=lambda b: 0.2)
    assert choice.budget == 0 and choice.table[0] == (0, 1.0, 1.0, 1.0)  # 1.3 in 1.4 do not
    assert choose_budget([0.9], gentle, (0, 1, 3), draft_cost=lambda b: 0.2).budget >= 1
    # a plain step's own costs beyond its forward count too: 1.3 tokens in 1.4 beat 1 in 1.2
    choice = choose_budget([0.3], gentle, (0, 1, 3), draft_cost=lambda b: 0.2, plain_cost=0.2)
    assert choice.budget == 1 and choice.table[0] == (0, 1.0, 1.2, 1.0 / 1.2)


def test_rank_acceptance_and_stats_by_rank():
    ra = RankAcceptance(prior=(0.5, 0.5), prior_weight=2)
    for _ in range(8):
        ra.observe(2, 1)
    assert ra.pooled()[1] == pytest.approx((8 + 1) / (8 + 2)) and ra.pooled()[0] == pytest.approx(1 / 10)
    # the same counts again as this generation's own, shrunk toward the pooled estimate
    assert ra.profile()[1] == pytest.approx((8 + ra.pooled()[1] * 8) / (8 + 8))
    lay = TreeLayout.for_proposal([-1, -1, 1, 1, 3], 5)
    res = greedy_tree_verify(torch.tensor([5, 7, 3, 4, 9]), [-1, -1, 1, 1, 3],
                             torch.nn.functional.one_hot(torch.tensor([7, 1, 4, 0, 9, 2]), 10).float())
    stats = SpecStats(tree="t")
    stats.observe(res, lay)
    assert stats.accepted_depth_counts == [0, 0, 0, 1]
    assert stats.offered_by_rank == [3, 2] and stats.accepted_by_rank == [1, 2]
    assert stats.drafted_by_position == [1, 1, 1] and stats.accepted_by_position == [1, 1, 1]
    assert stats.nodes_per_step == 5 and "sibling rank" in stats.summary()


def test_rank_acceptance_follows_the_generation_at_hand():
    """Counts of earlier generations are the prior of the current one's: a generation whose first drafts
    keep failing moves the estimate below the pooled one within a few offers, the next generation starts
    from the pooled estimate again, and the pooled one keeps everything."""
    ra = RankAcceptance(prior=(0.5,), prior_weight=8, local_weight=8)
    for _ in range(200):  # earlier generations: the first draft accepted 80% of the time
        ra.observe(1, 0 if _ % 5 else None)
    ra.new_generation()
    pooled = ra.pooled()[0]
    assert pooled == pytest.approx((160 + 4) / (200 + 8)) and ra.profile()[0] == pytest.approx(pooled)
    for _ in range(8):  # this generation: none accepted
        ra.observe(1, None)
    assert ra.profile()[0] == pytest.approx(ra.pooled()[0] * 8 / 16) and ra.profile()[0] < 0.4 < ra.pooled()[0]
    ra.new_generation()
    assert ra.profile()[0] == pytest.approx(ra.pooled()[0]) and ra.pooled()[0] == pytest.approx((160 + 4) / (208 + 8))


class TableScorer:
    """A tree builder Scorer whose children's logits depend on the depth only; records what it fed."""

    d2t = None

    def __init__(self, logits):
        self.logits, self.fed = torch.tensor(logits), []

    def feed(self, cands, nodes):
        self.fed.append(list(nodes))

    def child_logits(self, cands, nodes):
        return self.logits[cands[nodes[0]].depth if nodes[0] >= 0 else 0].expand(len(nodes), -1)

    def q_of(self, logits):
        return logits.softmax(-1)

    def ranking(self, logits):
        return logits.softmax(-1)


def test_tree_builder_static_and_dynamic():
    from verispec.tree import build_tree, sample_without_replacement

    s = TableScorer([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 3.0, 2.0]])
    cands, keep = build_tree(s, StaticTree(((0,), (1,), (0, 0), (0, 1), (1, 0))))
    assert [(c.token, c.parent) for c in cands] == [(0, -1), (1, -1), (2, 0), (3, 0), (2, 1)] and keep == [0, 1, 2, 3, 4]
    assert s.fed == [[0, 1]] and cands[2].score == pytest.approx(float(s.ranking(s.logits)[0, 0] * s.ranking(s.logits)[1, 2]))
    s = TableScorer([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 3.0, 2.0]])
    cands, keep = build_tree(s, DynamicTree(budget=3, topk=2, depth=2))
    assert s.fed == [[0, 1]] and [(cands[c].token, cands[c].parent) for c in keep] == [(0, -1), (1, -1), (2, 0)]
    draws = sample_without_replacement(torch.tensor([0.5, 0.5, 0.0]), 3, torch.Generator().manual_seed(0))
    assert sorted(x for x, _, _ in draws) == [0, 1] and draws[1][2].tolist() == [float(i != draws[0][0]) for i in range(2)] + [0.0]
