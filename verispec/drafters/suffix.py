"""Suffix decoding (Oliaro et al. 2024, "SuffixDecoding: Extreme Speculative Decoding for Emerging AI
Applications", arXiv 2411.04975): drafts from suffix tries over this request (prompt + output so far)
and over the outputs of earlier requests, with no model call. Proposals are point masses.

The structure is a depth-limited suffix trie with occurrence counts (`SuffixTrie`): every substring of
at most `depth` tokens of the stored sequences is a node, and count(w) = the number of places w occurs.
So count(w + c) / sum over c' of count(w + c') is the empirical probability that c follows w. A plain
trie, not a path-compressed suffix tree: it costs up to `depth` nodes per stored token, but every
update is a few dict operations (appending a token extends the open suffixes by one node each, so the
current generation is indexed as it grows) and removing a sequence is the same walk with -1, which is
what a bounded cache that evicts needs.

Each step (after the paper's Sec. 3):
  * for each pattern length p (the last p tokens of the context, p < depth) that occurs in a trie,
    grow a speculation tree below the pattern's node best-first by the path score
    D(child) = D(node) * count(child) / sum of the node's children's counts (D = 1 at the pattern),
    keeping nodes with D >= min_prob, at most MAX_SPEC = floor(alpha * p) nodes (the paper's adaptive
    rule: a longer match earns a longer speculation), and at most what the engine asked for (the
    chain length k, or the tree shape's budget, branching and depth);
  * score a tree by the sum of its D (its expected number of accepted tokens under the counts) and
    propose the best tree over both tries and all p (ties: the longer pattern, then this request's trie).
Ties between nodes of equal D go to the lexicographically smaller token path, so a proposal is a
deterministic function of the stored sequences (what the unit tests check against brute force).

The cross-request cache (`SuffixCache`) holds the outputs of earlier generations of one model (the
paper's global tree; prompts are indexed per request only). It is bounded by its number of trie
nodes: after an insertion that passes `max_nodes`, whole sequences are evicted oldest first until it
fits. Every operation takes the cache's lock, so one cache serves a multi-threaded server. A
generation's output is added step by step (observe), so a request that is cut off still leaves what
it produced. `global_cache(name)` gives the one cache per model name that engines share by default.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

from verispec.errors import InvalidParameter
from verispec.drafters.base import Drafter
from verispec.types import Proposal, SamplingParams, StepResult

DEFAULT_DEPTH = 24            # the trie depth the paper's implementation defaults to (longest indexed substring)
DEFAULT_ALPHA = 1.0           # MAX_SPEC = alpha * matched pattern length
DEFAULT_MIN_PROB = 0.1        # nodes whose path score D falls below this are not proposed
DEFAULT_CACHE_NODES = 400_000  # about 100 MB of Python objects (see SuffixCache)
CACHE_SCOPES = ("global", "private", "off")


class SuffixTrie:
    """Depth-limited suffix trie with occurrence counts over several token sequences.

    Nodes are integers into parallel lists (count, children dict); node 0 is the root (the empty
    string). A sequence is opened, extended token by token, and can be removed again; removal frees
    the nodes whose count falls to 0 for reuse.
    """

    def __init__(self, depth: int = DEFAULT_DEPTH):
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 2:
            raise InvalidParameter(f"suffix trie depth must be an integer >= 2, got {depth!r}")
        self.depth = depth
        self._count: list[int] = [0]
        self._kids: list[dict[int, int] | None] = [None]
        self._free: list[int] = []
        self._seqs: dict[int, list[int]] = {}
        self._open: dict[int, list[int]] = {}  # seq id -> nodes of its suffixes of length L..1 (L < depth)

    # -- size ---------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Nodes in use, root excluded."""
        return len(self._count) - 1 - len(self._free)

    @property
    def sequences(self) -> list[int]:
        return list(self._seqs)

    def tokens(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id])

    # -- updates ------------------------------------------------------------------------------------

    def _child(self, node: int, token: int) -> int:
        kids = self._kids[node]
        if kids is None:
            kids = self._kids[node] = {}
        child = kids.get(token)
        if child is None:
            if self._free:
                child = self._free.pop()
                self._count[child], self._kids[child] = 0, None
            else:
                child = len(self._count)
                self._count.append(0)
                self._kids.append(None)
            kids[token] = child
        return child

    def open(self, seq_id: int) -> None:
        if seq_id in self._seqs:
            raise InvalidParameter(f"sequence {seq_id} is already in the suffix trie")
        self._seqs[seq_id] = []
        self._open[seq_id] = []

    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append tokens to an open sequence: each new end position adds one occurrence to each of its
        suffixes of length 1..depth."""
        seq, front = self._seqs[seq_id], self._open[seq_id]
        count = self._count
        for tok in tokens:
            tok = int(tok)
            nxt = []
            for node in front:  # suffixes of length L..1 -> L+1..2
                c = self._child(node, tok)
                count[c] += 1
                nxt.append(c)
            c = self._child(0, tok)
            count[c] += 1
            nxt.append(c)
            front = nxt[1:] if len(nxt) >= self.depth else nxt  # a suffix of full depth is not extended
            seq.append(tok)
        self._open[seq_id] = front

    def remove(self, seq_id: int) -> None:
        """Take a sequence's occurrences out again (the same walks as its insertion, counting down)."""
        seq = self._seqs.pop(seq_id)
        del self._open[seq_id]
        count, kids = self._count, self._kids
        for start in range(len(seq)):
            node = 0
            for tok in seq[start: start + self.depth]:
                child = kids[node][tok]
                count[child] -= 1
                if count[child] == 0:
                    # count(w + c) <= count(w), so below a node that reached 0 only this walk's chain
                    # remains, every node of it at count 1: free it whole
                    del kids[node][tok]
                    self._release_chain(child)
                    break
                node = child

    def _release_chain(self, node: int) -> None:
        while node is not None:
            kids = self._kids[node]
            nxt = next(iter(kids.values())) if kids else None
            self._count[node], self._kids[node] = 0, None
            self._free.append(node)
            node = nxt

    def clear(self) -> None:
        self.__init__(self.depth)

    # -- queries ------------------------------------------------------------------------------------

    def find(self, pattern: Sequence[int]) -> int | None:
        """The node of `pattern` (len <= depth), or None when it does not occur."""
        node = 0
        for tok in pattern:
            kids = self._kids[node]
            node = kids.get(int(tok)) if kids else None
            if node is None:
                return None
        return node

    def count(self, node: int) -> int:
        return self._count[node]

    def children(self, node: int) -> dict[int, int]:
        """token -> child node (a copy)."""
        return dict(self._kids[node] or {})

    def continuation_counts(self, pattern: Sequence[int]) -> dict[int, int]:
        """token c -> count(pattern + c); empty when the pattern does not occur or is at full depth."""
        node = self.find(pattern)
        if node is None:
            return {}
        return {t: self._count[c] for t, c in (self._kids[node] or {}).items()}


@dataclass
class SpecTree:
    """A speculation tree grown from one matched pattern: nodes in creation (topological) order."""

    tokens: list[int]
    parents: list[int]    # -1 = attached to the context
    scores: list[float]   # path score D of each node
    pattern_length: int

    @property
    def score(self) -> float:
        return sum(self.scores)

    def __len__(self) -> int:
        return len(self.tokens)


def grow_tree(trie: SuffixTrie, node: int, budget: int, *, topk: int | None = None, max_depth: int | None = None,
              min_prob: float = DEFAULT_MIN_PROB, allowed=None, pattern_length: int = 0) -> SpecTree:
    """Best-first expansion below `node`: the `budget` nodes of largest path score D (ties: smaller
    token path) among those with D >= min_prob, at most `max_depth` deep, whose sibling rank (by count,
    then token) is < topk at every step and, when `allowed` (a set of rank paths) is given, whose rank
    path is in it. A child's key is never before its parent's, so popping in key order yields a tree."""
    tokens: list[int] = []
    parents: list[int] = []
    scores: list[float] = []
    heap: list = []
    tie = itertools.count()

    def push_children(at: int, index: int, score: float, path: tuple, ranks: tuple) -> None:
        if max_depth is not None and len(path) >= max_depth:
            return
        kids = trie._kids[at]
        if not kids:
            return
        counts = trie._count
        total = sum(counts[c] for c in kids.values())
        ordered = sorted(kids.items(), key=lambda kv: (-counts[kv[1]], kv[0]))
        for rank, (tok, child) in enumerate(ordered):
            if topk is not None and rank >= topk:
                break
            d = score * counts[child] / total
            if d < min_prob:
                break  # the rest rank lower: no larger count, so no larger D
            rpath = ranks + (rank,)
            if allowed is not None and rpath not in allowed:
                continue
            heapq.heappush(heap, (-d, path + (tok,), next(tie), child, index, rpath))

    push_children(node, -1, 1.0, (), ())
    while heap and len(tokens) < budget:
        neg, path, _, child, parent, rpath = heapq.heappop(heap)
        tokens.append(path[-1])
        parents.append(parent)
        scores.append(-neg)
        push_children(child, len(tokens) - 1, -neg, path, rpath)
    return SpecTree(tokens, parents, scores, pattern_length)


def best_tree(trie: SuffixTrie, context: Sequence[int], budget: int, *, alpha: float = DEFAULT_ALPHA,
              max_pattern: int | None = None, **grow) -> SpecTree | None:
    """The highest-scoring speculation tree over every pattern length p that occurs in the trie, each
    limited to floor(alpha * p) nodes (ties: the longer pattern)."""
    best = None
    longest = min(len(context), trie.depth - 1, max_pattern or trie.depth)
    for p in range(1, longest + 1):
        node = trie.find(context[len(context) - p:])
        if node is None:
            break  # a longer pattern ends with this one, so it does not occur either
        cap = min(budget, math.floor(alpha * p + 1e-9))
        if cap < 1:
            continue
        tree = grow_tree(trie, node, cap, pattern_length=p, **grow)
        if len(tree) and (best is None or tree.score >= best.score):
            best = tree
    return best


class SuffixCache:
    """Outputs of earlier generations of one model, shared by every engine that holds this cache.

    Bounded by `max_nodes` trie nodes (a node costs about 250 bytes of Python objects: its count, its
    children dict and its entry in the parent's): after each insertion, whole sequences are evicted
    oldest first until the trie fits. Thread-safe: every method holds the cache's lock.
    """

    def __init__(self, max_nodes: int = DEFAULT_CACHE_NODES, depth: int = DEFAULT_DEPTH):
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise InvalidParameter(f"suffix cache size must be an integer >= 1 (trie nodes), got {max_nodes!r}")
        self.max_nodes = max_nodes
        self.trie = SuffixTrie(depth)
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self.trie)

    @property
    def sequences(self) -> int:
        with self._lock:
            return len(self.trie.sequences)

    def open(self) -> int:
        """A new sequence (one generation's output); returns its id."""
        with self._lock:
            seq = next(self._ids)
            self.trie.open(seq)
            return seq

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append to a sequence (ignored when it was evicted), then evict oldest-first to fit."""
        with self._lock:
            if seq_id not in self.trie._seqs:
                return
            self.trie.extend(seq_id, tokens)
            while len(self.trie) > self.max_nodes and self.trie._seqs:
                self.trie.remove(next(iter(self.trie._seqs)))  # dicts keep insertion order: oldest first
                self.evicted += 1

    def clear(self) -> None:
        with self._lock:
            self.trie.clear()

    def best_tree(self, context: Sequence[int], budget: int, **options) -> SpecTree | None:
        with self._lock:
            return best_tree(self.trie, context, budget, **options)


_GLOBAL: dict[str, SuffixCache] = {}
_GLOBAL_LOCK = threading.Lock()


def global_cache(model_name: str) -> SuffixCache:
    """The process-wide cache of one model's outputs (created on first use with the default bound)."""
    with _GLOBAL_LOCK:
        cache = _GLOBAL.get(model_name)
        if cache is None:
            cache = _GLOBAL[model_name] = SuffixCache()
        return cache


def _check_options(alpha, min_prob, depth) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 64:
        raise InvalidParameter(f"suffix_alpha must be a number in (0, 64] (max speculated tokens = alpha * match length), got {alpha!r}")
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not (0.0 <= min_prob <= 1.0):
        raise InvalidParameter(f"suffix_min_prob must be a number in [0, 1], got {min_prob!r}")
    if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= 64:
        raise InvalidParameter(f"suffix_depth must be an integer in [2, 64], got {depth!r}")


class SuffixDrafter(Drafter):
    """Drafts from a suffix trie over this request and an optional cross-request SuffixCache."""

    name = "suffix"
    can_tree = True

    def __init__(self, cache: SuffixCache | None = None, alpha: float = DEFAULT_ALPHA,
                 min_prob: float = DEFAULT_MIN_PROB, depth: int = DEFAULT_DEPTH):
        _check_options(alpha, min_prob, depth)
        self.cache, self.alpha, self.min_prob, self.depth = cache, float(alpha), float(min_prob), depth
        self.trie = SuffixTrie(depth)
        self._seq: int | None = None

    def begin(self, prompt: list[int], params: SamplingParams, generator: torch.Generator | None) -> None:
        self.trie = SuffixTrie(self.depth)
        self.trie.open(0)
        self.trie.extend(0, prompt)
        self._seq = self.cache.open() if self.cache is not None else None

    def _sync(self, context: list[int]) -> None:
        """Index the tokens committed since the last call (the context is the authority)."""
        seen = self.trie._seqs.get(0)
        n = len(seen) if seen is not None else 0
        if seen is None or n > len(context) or list(context[:n]) != seen:
            self.trie = SuffixTrie(self.depth)
            self.trie.open(0)
            n = 0
        self.trie.extend(0, context[n:])

    def best(self, context: list[int], budget: int, **grow) -> SpecTree | None:
        """The best speculation tree over this request's trie and the cache (grow: grow_tree's options)."""
        self._sync(context)
        opts = dict(alpha=self.alpha, min_prob=self.min_prob, **grow)
        best = best_tree(self.trie, context, budget, **opts)
        if self.cache is not None:
            other = self.cache.best_tree(context, budget, max_pattern=self.depth - 1, **opts)
            if other is not None and (best is None or (other.score, other.pattern_length) > (best.score, best.pattern_length)):
                best = other
        return best

    def propose(self, context: list[int], k: int) -> Proposal | None:
        tree = self.best(context, k, topk=1, max_depth=k)
        if tree is None:
            return None
        return Proposal(tokens=torch.tensor(tree.tokens, dtype=torch.long))

    def propose_tree(self, context: list[int], shape) -> Proposal | None:
        from verispec.tree import StaticTree

        if isinstance(shape, StaticTree):
            tree = self.best(context, len(shape.paths), max_depth=shape.depth, allowed=set(shape.paths))
        else:
            tree = self.best(context, shape.budget or 16, topk=shape.topk, max_depth=shape.depth)
        if tree is None:
            return None
        return Proposal(tokens=torch.tensor(tree.tokens, dtype=torch.long), parents=list(tree.parents))

    def observe(self, result: StepResult) -> None:
        if self.cache is not None and self._seq is not None:
            self.cache.extend(self._seq, result.tokens)

    def forget(self) -> None:
        """Drop the cross-request memory (a benchmark starts each contender cold after its warm-up)."""
        if self.cache is not None:
            self.cache.clear()


def make_suffix_drafter(model_name: str, cache="global", alpha: float = DEFAULT_ALPHA,
                        min_prob: float = DEFAULT_MIN_PROB, depth: int = DEFAULT_DEPTH) -> SuffixDrafter:
    """cache: "global" (the model's process-wide cache, shared by every engine: the server's requests),
    "private" (a cache of this drafter's own, kept across its generations), "off" (this request only),
    or a SuffixCache."""
    _check_options(alpha, min_prob, depth)
    if isinstance(cache, SuffixCache):
        shared = cache
    elif cache == "global":
        shared = global_cache(model_name)
    elif cache == "private":
        shared = SuffixCache()
    elif cache == "off" or cache is None:
        shared = None
    else:
        raise InvalidParameter(f"suffix_cache must be one of {', '.join(CACHE_SCOPES)} (or a SuffixCache), got {cache!r}")
    return SuffixDrafter(shared, alpha=alpha, min_prob=min_prob, depth=depth)
