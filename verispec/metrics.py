"""Speculation statistics for one generation: a dataclass with observe(), kept apart from logging.

tau (mean accepted length) = tokens committed per target forward in the decode loop, bonus included.
alpha (acceptance rate)    = accepted draft tokens / drafted tokens.

Trees: drafted counts every node (so alpha is accepted path length / nodes verified); "position" is the
tree depth (a depth counts as drafted once per step when the tree reaches it, accepted when the accepted
path reaches it), and acceptance by sibling rank says how often the r-th candidate was the one taken.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from verispec.tree.layout import count_ranks
from verispec.types import StepResult


@dataclass
class SpecStats:
    method: str = "ar"
    prompt_tokens: int = 0
    new_tokens: int = 0          # tokens emitted to the user (after max_new_tokens / stop truncation)
    steps: int = 0               # target forwards in the decode loop (verification steps)
    drafted: int = 0
    accepted: int = 0
    committed: int = 0           # tokens produced by the steps (before truncation)
    drafted_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    nodes_verified: int = 0      # tree: nodes sent to the target (chain: = drafted)
    tree: str = ""               # the tree shape, "" for chains
    tree_steps: int = 0          # steps that verified a tree
    max_nodes: int = 0           # largest tree (drafted nodes) verified in one step
    accepted_depth_counts: list[int] = field(default_factory=list)  # steps by accepted depth (tree steps)
    offered_by_rank: list[int] = field(default_factory=list)   # walk nodes offering >= r+1 children
    accepted_by_rank: list[int] = field(default_factory=list)  # ... whose accepted child had rank r
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    first_token_time: float | None = None
    finish_reason: str = ""

    def observe(self, result: StepResult, layout=None) -> None:
        """Record one step. layout: the step's tree.TreeLayout (node 0 = the root; depths give each node's
        position) when it verified a tree, None for a plain chain (node i at position i)."""
        self.steps += 1
        self.drafted += result.num_drafted
        self.accepted += result.num_accepted
        self.nodes_verified += result.num_drafted
        self.committed += len(result.tokens)
        depths = range(result.num_drafted) if layout is None else [int(d) - 1 for d in layout.depths[1:].tolist()]
        # position i counts as "reached" once per step when some node at depth i was drafted
        for d in sorted(set(depths)):
            self._grow(d)
            self.drafted_by_position[d] += 1
        for d in range(result.num_accepted):
            self._grow(d)
            self.accepted_by_position[d] += 1
        if layout is None:
            return
        self.tree_steps += 1
        self.max_nodes = max(self.max_nodes, result.num_drafted)
        while len(self.accepted_depth_counts) <= result.num_accepted:
            self.accepted_depth_counts.append(0)
        self.accepted_depth_counts[result.num_accepted] += 1
        for offered, rank in layout.walk_ranks(result.accepted_nodes):
            count_ranks(self.offered_by_rank, self.accepted_by_rank, offered, rank)

    @property
    def nodes_per_step(self) -> float:
        return self.nodes_verified / self.steps if self.steps else 0.0

    @property
    def mean_accepted_depth(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def acceptance_by_rank(self) -> list[float]:
        return [a / o if o else 0.0 for a, o in zip(self.accepted_by_rank, self.offered_by_rank)]

    def _grow(self, d: int) -> None:
        while len(self.drafted_by_position) <= d:
            self.drafted_by_position.append(0)
            self.accepted_by_position.append(0)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_by_position, self.drafted_by_position)]

    @property
    def decode_time(self) -> float:
        return max(self.total_time - self.prefill_time, 0.0)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_time if self.total_time > 0 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, mean_accepted_length=self.mean_accepted_length,
                 acceptance_by_position=self.acceptance_by_position, tokens_per_second=self.tokens_per_second,
                 nodes_per_step=self.nodes_per_step, mean_accepted_depth=self.mean_accepted_depth,
                 acceptance_by_rank=self.acceptance_by_rank)
        return d

    def summary(self) -> str:
        s = f"{self.new_tokens} tokens in {self.total_time:.2f} s ({self.tokens_per_second:.1f} tok/s), {self.steps} target forwards"
        if self.drafted:
            pos = " ".join(f"{a:.2f}" for a in self.acceptance_by_position[:8])
            s += (f"; drafted {self.drafted}, accepted {self.accepted} (rate {self.acceptance_rate:.2f}), "
                  f"mean accepted length {self.mean_accepted_length:.2f}; by position [{pos}]; "
                  f"time drafting {self.draft_time:.2f} s, verifying {self.verify_time:.2f} s")
        if self.tree and self.drafted:
            ranks = " ".join(f"{a:.2f}" for a in self.acceptance_by_rank[:6])
            s += (f"; tree {self.tree}: {self.nodes_per_step:.1f} nodes/step (max {self.max_nodes}), "
                  f"accepted depth {self.mean_accepted_depth:.2f} (by position = by depth); by sibling rank [{ranks}]")
        return s
