"""Speculation statistics for one generation: a dataclass with observe(), kept apart from logging.

tau (mean accepted length) = tokens committed per target forward in the decode loop, bonus included.
alpha (acceptance rate)    = accepted draft tokens / drafted tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

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
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    total_time: float = 0.0
    first_token_time: float | None = None
    finish_reason: str = ""

    def observe(self, result: StepResult, depths: list[int] | None = None) -> None:
        """Record one step. depths: draft position (chain) or tree depth of each drafted node, 0-based."""
        self.steps += 1
        self.drafted += result.num_drafted
        self.accepted += result.num_accepted
        self.nodes_verified += result.num_drafted
        self.committed += len(result.tokens)
        if depths is None:
            depths = list(range(result.num_drafted))
        # position i counts as "reached" once per step when some node at depth i was drafted
        reached = sorted(set(depths))
        for d in reached:
            self._grow(d)
            self.drafted_by_position[d] += 1
        for d in range(result.num_accepted):
            self._grow(d)
            self.accepted_by_position[d] += 1

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
                 acceptance_by_position=self.acceptance_by_position, tokens_per_second=self.tokens_per_second)
        return d

    def summary(self) -> str:
        s = f"{self.new_tokens} tokens in {self.total_time:.2f} s ({self.tokens_per_second:.1f} tok/s), {self.steps} target forwards"
        if self.drafted:
            pos = " ".join(f"{a:.2f}" for a in self.acceptance_by_position[:8])
            s += (f"; drafted {self.drafted}, accepted {self.accepted} (rate {self.acceptance_rate:.2f}), "
                  f"mean accepted length {self.mean_accepted_length:.2f}; by position [{pos}]; "
                  f"time drafting {self.draft_time:.2f} s, verifying {self.verify_time:.2f} s")
        return s
