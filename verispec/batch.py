"""Many generations advanced together, one target forward per step for all of them (continuous batching).

    batch = Batch(max_batch=8, positions=16)
    run = batch.add(engine, prompt_ids, params)    # prefilled now; one Engine per sequence (its runner's
                                                   # KV cache, its drafter), engines of one model share weights
    while batch.active:
        for run, event in batch.step():            # one verification step of every active sequence
            ...
    generation = run.result()

A step: every sequence plans its nodes (`Decoding.plan`: its own drafter, draft length, tree), the
target scores all of them together (`backends.forward_many`: on the fast backend one pass over every
sequence's rows, the projections and the MLP as one GEMM, attention per sequence over its own cache),
and each sequence verifies and commits its own path with its own sampling generator
(`Decoding.finish`). Sequences join (`add`) and leave (finished, or cancelled) between steps, so a
server admits a request without waiting for the batch to drain.

Speculation and batching share a step's positions: at batch size 1 a forward over a few positions
costs about one position's time (the weights are read once), so drafts are nearly free; a batch
spends those positions on other users' tokens. `positions` is the step's budget of verified
positions across the batch; each sequence drafts at most `positions // B - 1` tokens (0: it decodes
plainly). `free_positions` picks it from the runner's measured cost curve: the most positions one
forward scores within `slack` of the cost of one.

Exact mode is batch-invariant: a sequence's rows get the same operations as alone (its padding rows
included), attention reads only its own cache, and the shared GEMMs give a row the same bits at any
row count the kernels were probed for (fast/row_invariance.py), so a greedy sequence's tokens are
bit-identical whatever shares its batch and whenever it joined.
"""

from __future__ import annotations

from typing import Callable

from verispec.backends import forward_many
from verispec.engine import Decoding, Engine
from verispec.errors import InvalidParameter
from verispec.output import StepEvent
from verispec.types import SamplingParams


def free_positions(cost: dict[int, float], slack: float = 1.25) -> int:
    """The most positions one forward scores within `slack` x the cost of one position (a measured cost
    curve, tree.measure_verify_cost: positions -> seconds); at least 1."""
    if 1 not in cost:
        raise InvalidParameter("the cost curve needs the cost of one position")
    return max([n for n, t in cost.items() if t <= slack * cost[1]] + [1])


class Batch:
    """The sequences that step together; at most `max_batch` at once and `positions` verified positions a
    step (None: each sequence drafts as it would alone)."""

    def __init__(self, max_batch: int = 8, positions: int | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidParameter(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if positions is not None and (not isinstance(positions, int) or positions < 1):
            raise InvalidParameter(f"positions must be an integer >= 1 or None, got {positions!r}")
        self.max_batch, self.positions = max_batch, positions
        self.active: list[Decoding] = []
        self._stops: dict[int, Callable[[], bool] | None] = {}

    @property
    def full(self) -> bool:
        return len(self.active) >= self.max_batch

    def draft_share(self) -> int | None:
        """The most tokens each sequence drafts this step (None: no cap)."""
        if self.positions is None or not self.active:
            return None
        return max(0, self.positions // len(self.active) - 1)

    def add(self, engine: Engine, prompt_ids: list[int], params: SamplingParams,
            should_stop: Callable[[], bool] | None = None) -> Decoding:
        """Start a generation on `engine` (its own runner and drafter, not shared with another active
        sequence): the prompt is prefilled now, alone (should_stop is asked between its chunks and
        before each later step). Returns its Decoding; a cancelled prefill returns it finished."""
        if self.full:
            raise InvalidParameter(f"the batch holds {self.max_batch} sequences already; wait for one to finish")
        if any(run.engine is engine or run.engine.runner is engine.runner for run in self.active):
            raise InvalidParameter("each sequence needs its own engine and runner (its own KV cache)")
        run = Decoding(engine, prompt_ids, params)
        run.prefill(should_stop)
        if not run.finished:
            self.active.append(run)
            self._stops[id(run)] = should_stop
        return run

    def cancel(self, run: Decoding) -> None:
        """End `run` now ("cancelled"); the others go on."""
        if run in self.active:
            self._leave(run)
        run.cancel()

    def _leave(self, run: Decoding) -> None:
        self.active.remove(run)
        self._stops.pop(id(run), None)

    def step(self) -> list[tuple[Decoding, StepEvent | None]]:
        """One verification step of every active sequence -> (run, its StepEvent) each; a run that its
        should_stop cancelled before the step comes with None. Finished runs leave the batch."""
        report: list[tuple[Decoding, StepEvent | None]] = []
        for run in list(self.active):
            stop = self._stops[id(run)]
            if stop is not None and stop():
                self.cancel(run)
                report.append((run, None))
        if not self.active:
            return report
        share = self.draft_share()
        runs = list(self.active)
        calls = [(run.engine.runner, run.plan(share)) for run in runs]
        for run, scores in zip(runs, forward_many(calls)):
            report.append((run, run.finish(scores)))
            if run.finished:
                self._leave(run)
        return report
