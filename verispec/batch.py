"""Many generations advanced together, one target forward per step for all of them (continuous batching).

    batch = Batch(max_batch=8, cost=measure_verify_cost(runner))   # or positions=16: a fixed budget
    run = batch.add(engine, prompt_ids, params)    # prefilled now; one Engine per sequence (its runner's
                                                   # KV cache, its drafter), engines of one model share weights
    while batch.active:
        for run, event in batch.step():            # one verification step of every active sequence
            ...
    generation = run.result()

    for key, run in continuous(batch, engines, [(key, prompt_ids, params), ...]):   # a queue of jobs on a
        ...                                        # pool of engines: a freed engine takes the next job at once

A step: every sequence plans its nodes (`Decoding.plan`: its own drafter, draft length, tree), the
target scores all of them together (`backends.forward_many`: on the fast backend one pass over every
sequence's rows, the projections and the MLP as one GEMM, attention per sequence over its own cache),
and each sequence verifies and commits its own path with its own sampling generator
(`Decoding.finish`). Sequences join (`add`) and leave (finished, or cancelled) between steps, so a
server admits a request without waiting for the batch to drain.

Speculation and batching share a step's positions: at batch size 1 a forward over a few positions
costs about one position's time (the weights are read once), so drafts are nearly free; a batch
spends those positions on other users' tokens. A step's budget of verified positions N across the
batch gives each of B sequences at most `N // B - 1` drafted tokens (0: it decodes plainly). N is
fixed (`positions`) or chosen each step from the runner's measured cost curve (`cost`):
`free_positions(cost, rows=B)`, the most positions one forward scores within `slack` of the cost of
the B positions the batch pays for anyway, so drafts stay while they add little to the step.

Exact mode is batch-invariant: a sequence's rows get the same operations as alone (its padding rows
included), attention reads only its own cache, and the shared GEMMs give a row the same bits at any
row count the kernels were probed for (fast/row_invariance.py), so a greedy sequence's tokens are
bit-identical whatever shares its batch and whenever it joined.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterator

from verispec.backends import forward_many
from verispec.engine import Decoding, Engine
from verispec.errors import InvalidParameter
from verispec.output import StepEvent
from verispec.theory import CostCurve
from verispec.types import SamplingParams


def cost_envelope(cost: dict[int, float]) -> dict[int, float]:
    """A measured cost curve made non-decreasing: each size takes the cheapest cost measured at it or any
    larger size. More positions never cost less than fewer, so a higher figure is noise (other work on
    the cores); taking the lower one means a slow probe of one position cannot make large forwards look
    free."""
    sizes = sorted(cost)
    return {n: min(cost[m] for m in sizes[i:]) for i, n in enumerate(sizes)}


def free_positions(cost: dict[int, float], rows: int = 1, slack: float = 1.25) -> int:
    """The most positions one forward scores within `slack` x the cost of `rows` positions, the forward a
    batch of `rows` sequences pays anyway when each decodes plainly; at least `rows`. cost: a measured cost
    curve (tree.measure_verify_cost: positions -> seconds), taken through cost_envelope, and between
    measured sizes as theory.CostCurve interpolates it."""
    if 1 not in cost:
        raise InvalidParameter("the cost curve needs the cost of one position")
    curve = cost_envelope(cost)
    limit = slack * CostCurve(list(curve), list(curve.values())).seconds(rows)
    return max([n for n, t in curve.items() if t <= limit] + [rows])


class Batch:
    """The sequences that step together: at most `max_batch` at once, and a step's verified positions
    across them either fixed (`positions`) or chosen each step from a measured cost curve (`cost`:
    free_positions at the batch's size); neither: each sequence drafts as it would alone."""

    def __init__(self, max_batch: int = 8, positions: int | None = None, cost: dict[int, float] | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidParameter(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if positions is not None and (not isinstance(positions, int) or positions < 1):
            raise InvalidParameter(f"positions must be an integer >= 1 or None, got {positions!r}")
        if positions is not None and cost is not None:
            raise InvalidParameter("give a fixed positions budget or a cost curve, not both")
        if cost is not None:
            free_positions(cost)  # checks the curve now, not mid-run
        self.max_batch, self.positions, self.cost = max_batch, positions, cost
        self.active: list[Decoding] = []
        self._stops: dict[int, Callable[[], bool] | None] = {}

    @property
    def full(self) -> bool:
        return len(self.active) >= self.max_batch

    def step_positions(self) -> int | None:
        """This step's budget of verified positions across the batch (None: no cap)."""
        if self.cost is not None and self.active:
            return free_positions(self.cost, rows=len(self.active))
        return self.positions

    def draft_share(self) -> int | None:
        """The most tokens each sequence drafts this step (None: no cap)."""
        budget = self.step_positions()
        if budget is None or not self.active:
            return None
        return max(0, budget // len(self.active) - 1)

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



def continuous(batch: Batch, engines: list[Engine], jobs: list[tuple[Hashable, list[int], SamplingParams]],
               admit: Callable[[], bool] | None = None) -> Iterator[tuple[Hashable, Decoding]]:
    """Run jobs (key, prompt_ids, params) through `batch` on a pool of engines, continuous: a job starts, in
    order, as soon as an engine is free of active runs and admit() (None: always) allows; the jobs left
    when it stops allowing are dropped. Yields (key, run) for every run after each step it took, and for a
    run that finished in its prefill; the caller may batch.cancel(run) then, and its engine is free for
    the next job. (api.generate_batch and train.data.engine_answers run on it.)"""
    if jobs and not engines:
        raise InvalidParameter("continuous batching needs at least one engine")
    queue, keys = list(jobs), {}
    while queue or batch.active:
        idle = [e for e in engines if all(r.engine is not e for r in batch.active)]
        while queue and idle and not batch.full and (admit is None or admit()):
            key, ids, params = queue.pop(0)
            run = batch.add(idle.pop(), ids, params)
            keys[id(run)] = key
            if run.finished:
                yield key, run
        if admit is not None and not admit():
            queue.clear()
        for run, _ in batch.step() if batch.active else []:
            yield keys[id(run)], run
        keys = {id(r): keys[id(r)] for r in batch.active}
