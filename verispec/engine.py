"""The speculative decoding loop (plain decoding is the case with no drafter).

    prefill(prompt[:-1])                 the last committed token is always "pending": not yet in the cache
    repeat:
      proposal = drafter.propose(...)    k tokens (or a tree of the auto budget's choose()), draft probabilities
      logits   = target([pending] + proposal)   ONE forward pass (a tree: under its ancestor mask)
      result   = verify(proposal, logits)       accepted tokens + one recovered/bonus token (acceptance.py)
      runner.commit(the accepted path's slots)  a chain's path is a crop; a tree's is compacted
      stats.observe(result); budget.observe(the step's time)   (tree/budget.AutoBudget)

A chain is the tree whose parents are the previous node; the engine treats both alike and lets
acceptance.py pick the chain's fast rule. A proposal may carry auxiliary nodes (lookahead decoding's
window): they join the same forward and mask, are never accepted, and their logits go back to the
drafter in StepResult.aux_logits. The target is a backends.Runner; what a drafter can do (trees,
target features) it declares (drafters/base.py).

A generation in progress is a `Decoding`, whose step is cut where the forward goes (plan -> forward ->
finish), so that Engine.stream runs one and batch.Batch runs many with one forward for all.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from verispec.acceptance import verify
from verispec.backends import Forward, Runner, Scores, TreeMask
from verispec.drafters.base import DraftLengthSchedule, Drafter
from verispec.errors import InvalidParameter, InvalidPrompt
from verispec.metrics import SpecStats
from verispec.output import Output, StepEvent
from verispec.sampling import make_generator
from verispec.tree import AutoBudget, DynamicTree, StaticTree, TreeLayout, TreeShape, measure_verify_cost, parse_tree
from verispec.types import Proposal, SamplingParams

FREE_NODES = 16  # the most nodes a free proposal (Drafter.propose_free) may verify: suffix decoding's own tree size


@dataclass
class Generation:
    """The finished result of one generation."""

    text: str
    token_ids: list[int]
    prompt_ids: list[int]
    stats: SpecStats
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or context window),
    #                     "cancelled" (Engine.stream's should_stop said so)
    kinds: list[str] = field(default_factory=list)


@dataclass
class _Nodes:
    """One step's nodes as the target sees them: the pending token, the drafted nodes, the auxiliary
    ones. tree: their mask (None: a plain chain, a causal forward); layout: the drafted nodes' tree
    for acceptance and statistics (None: a plain chain); parents None picks the chain rule."""

    ids: list[int]
    drafted: torch.Tensor
    parents: list[int] | None = None
    draft_probs: torch.Tensor | None = None
    tree: TreeMask | None = None
    layout: TreeLayout | None = None
    aux: int = 0
    free: bool = False  # Proposal.free: its verdict does not teach the auto budget

    @classmethod
    def of(cls, pending: int, proposal: Proposal | None, max_depth: int) -> "_Nodes":
        if proposal is None:
            return cls([pending], torch.empty(0, dtype=torch.long))
        draft = proposal.tokens.tolist()
        aux = proposal.aux_tokens.tolist() if proposal.aux_tokens is not None else []
        nodes = cls([pending] + draft + aux, proposal.tokens, proposal.parents, proposal.draft_probs, aux=len(aux),
                    free=proposal.free)
        if proposal.parents is None and not aux:
            return nodes
        nodes.layout = TreeLayout.for_proposal(proposal.parents, len(draft))
        if int(nodes.layout.depths.max()) > max_depth:
            raise InvalidParameter(f"the drafter proposed a tree deeper than the {max_depth} tokens asked for")
        nodes.parents = [p - 1 for p in nodes.layout.parents[1:]]
        # auxiliary nodes ride in the same forward (after the drafted ones, so their rows come last) and
        # leave the cache with the rejected nodes
        full = nodes.layout if not aux else TreeLayout.for_proposal(nodes.parents + list(proposal.aux_parents),
                                                                   len(draft) + len(aux))
        nodes.tree = TreeMask(full.mask, full.depths)
        return nodes


class Engine:
    """Runs generations for one target (runner) and one optional drafter."""

    def __init__(self, runner: Runner, eos_ids: set[int], decode: Callable[[list[int]], str], context_length: int,
                 drafter: Drafter | None = None, draft_length: int = 5, adaptive: bool = False,
                 max_draft_length: int = 16, method: str | None = None, device: torch.device | str = "cpu",
                 tree: TreeShape | str | None = None, verify_cost: dict[int, float] | None = None):
        if not isinstance(draft_length, int) or draft_length < 1:
            raise InvalidParameter(f"draft length must be an integer >= 1, got {draft_length}")
        self.tree = parse_tree(tree)
        if self.tree is not None:
            if drafter is None:
                raise InvalidParameter("a tree needs a drafter; choose a method other than 'ar'")
            if not drafter.can_tree:
                raise InvalidParameter(f"the '{drafter.name}' drafter cannot make trees; drop the tree option")
            runner.check_tree_support()
            drafter.check_tree_support()
        # drafters that read the target's hidden features (EAGLE, Medusa) get them for every committed
        # position whose KV entry the target cache holds: the prefill, then each step's accepted path
        self.features = tuple(drafter.feature_layers) if drafter is not None else ()
        if self.features and not runner.can_features:
            raise InvalidParameter(f"the '{drafter.name}' drafter needs the target's hidden features, "
                                   "which this backend does not expose")
        # the hardware-aware budget of a dynamic tree without a node count (tree/budget.py): it chooses each
        # step's nodes and learns from the steps; the other trees and plain decoding never ask it
        self.budget = AutoBudget(verify_cost)
        self.runner, self.eos_ids, self.decode = runner, set(eos_ids), decode
        self.context_length = context_length
        self.drafter = drafter
        self.draft_length, self.adaptive, self.max_draft_length = draft_length, adaptive, max_draft_length
        self.method = method or (drafter.name if drafter is not None else "ar")
        self.device = torch.device(device)
        self.last: Generation | None = None

    @classmethod
    def for_model(cls, target, drafter: Drafter | None = None, backend: str = "auto",
                  runner_options: dict | None = None, runner=None, **kwargs) -> "Engine":
        """backend: "auto" (the fast path when the model family has one, else transformers), "hf" or
        "fast"; runner_options go to backends.fast.FastRunner (exact, compile, ...)."""
        from verispec.backends import make_runner

        if runner is None:  # else: a runner reused from an earlier engine (it is reset per generation)
            # the loaded model's weights format and its file's own weights (fast/quant.py), unless overridden
            opts = {"weights": target.weights, "weight_source": target.weight_source,
                    **{k: v for k, v in (runner_options or {}).items() if v is not None or k != "weights"}}
            # slack past the context for tree nodes that share the last positions
            runner = make_runner(target.model, backend, capacity=target.context_length + 256, **opts)
        return cls(runner, target.eos_token_ids, target.decode, target.context_length,
                   drafter=drafter, device=target.device, **kwargs)

    def tree_shape(self, max_depth: int, max_nodes: int | None = None) -> TreeShape | None:
        """The tree to ask the drafter for this step, cut to `max_depth` (the room left); max_nodes caps a
        dynamic tree's budget and a static tree's depth (a batch's share of the step's positions). None: the
        auto budget chose a plain step."""
        tree = self.tree
        if isinstance(tree, StaticTree):
            if max_nodes is not None:
                max_depth = min(max_depth, max_nodes)
            return tree.truncated(max_depth) if tree.depth > max_depth else tree
        budget = tree.budget
        if budget is None:
            budget = self.budget.choose(tree.depth)
            if budget == 0:
                return None
        if max_nodes is not None:
            budget = min(budget, max_nodes)
        return DynamicTree(budget=budget, topk=tree.topk, depth=min(tree.depth, max_depth))

    @property
    def verify_cost(self) -> dict[int, float] | None:
        """The cost curve the auto budget prices forwards with (positions -> seconds; None: not measured)."""
        return self.budget.verify_cost

    def forget(self) -> None:
        """Drop what the drafter keeps across generations (Drafter.forget; plain decoding keeps nothing)."""
        if self.drafter is not None:
            self.drafter.forget()

    def prefill(self, ids: list[int], should_stop: Callable[[], bool] | None = None):
        """Feed `ids` into the target's cache -> (stopped, the features of every position or None).

        With should_stop, the prompt goes in chunks and should_stop() is asked between them (True: stop
        now), so a timeout or a gone client stops a long prompt within one chunk. The chunks are the
        runner's own prefill passes (Runner.prefill_chunk), so the cache gets the same values as one
        call gives; without should_stop it is one call.
        """
        chunk = len(ids) if should_stop is None else self.runner.prefill_chunk
        features = []
        for start in range(0, len(ids), chunk):
            if start and should_stop():
                return True, None
            features.append(self.runner.forward(ids[start:start + chunk], last_only=True, features=self.features).features)
        if not self.features:
            return False, None
        return False, features[0] if len(features) == 1 else torch.cat(features, dim=0)

    def propose(self, context: list[int], k: int, room: int, max_nodes: int | None = None) -> Proposal | None:
        """The drafter's proposal for this step (None: decode one token plainly)."""
        if self.drafter is None or k <= 0:
            return None
        # a free proposal needs no budget; its size is the drafter's own, capped as a dynamic tree's is
        cap = FREE_NODES if max_nodes is None else min(FREE_NODES, max_nodes)
        trees = self.tree is not None
        proposal = self.drafter.propose_free(context, room - 1 if trees else k, cap, trees)
        if proposal is not None and len(proposal):
            return replace(proposal, free=True)
        if self.tree is not None:
            shape = self.tree_shape(room - 1, max_nodes)
            if shape is None:
                return None  # the auto budget: drafting is not expected to pay for itself this step
            proposal = self.drafter.propose_tree(context, shape)
        else:
            proposal = self.drafter.propose(context, k)
        if proposal is not None and len(proposal) == 0 and (proposal.aux_tokens is None or not len(proposal.aux_tokens)):
            return None
        return proposal

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               should_stop: Callable[[], bool] | None = None) -> Iterator[StepEvent]:
        """Yield a StepEvent per verification step; the finished Generation is then in self.last.

        should_stop (a server's deadline or disconnect check) is asked between prefill chunks and
        between steps; when it returns True the generation ends with finish_reason "cancelled".
        """
        run = Decoding(self, prompt_ids, params)
        run.prefill(should_stop)
        while not run.finished:
            if should_stop is not None and should_stop():
                run.cancel()
                break
            t0 = time.perf_counter()
            call = run.plan()  # propose
            scores = self.runner.forward(call.ids, tree=call.tree, features=call.features)  # verify in one pass
            event = run.finish(scores)  # accept, commit
            self.budget.observe(len(call.ids), time.perf_counter() - t0)  # what the step cost
            yield event
        self.last = run.result()

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        for _ in self.stream(prompt_ids, params):
            pass
        assert self.last is not None
        return self.last


class Decoding:
    """One generation in progress: its output, sampling generator, draft-length schedule and statistics.

    A step is split where the target forward goes: `plan()` asks the drafter and returns the forward
    the step needs (`Forward`: the pending token and the proposal, their tree mask, the feature layers);
    `finish(scores)` verifies, commits the accepted path and returns the StepEvent. Engine.stream runs
    one Decoding with the engine's runner; batch.Batch runs many and scores all their forwards at once
    (backends.forward_many). Each Decoding needs its own Engine (runner: its KV cache; drafter: its
    state).
    """

    def __init__(self, engine: Engine, prompt_ids: list[int], params: SamplingParams):
        if not prompt_ids:
            raise InvalidPrompt("the prompt is empty; give some text")
        if len(prompt_ids) >= engine.context_length:
            raise InvalidPrompt(f"the prompt has {len(prompt_ids)} tokens but the model takes at most "
                                f"{engine.context_length}; shorten it")
        self.engine, self.params, self.prompt_ids = engine, params, list(prompt_ids)
        self.t_start = time.perf_counter()
        self.stats = SpecStats(method=engine.method, prompt_tokens=len(prompt_ids),
                               tree=engine.tree.describe() if engine.tree is not None else "")
        self.generator = make_generator(params.seed, engine.device)
        self.schedule = DraftLengthSchedule(engine.draft_length, engine.adaptive, engine.max_draft_length)
        self.out = Output(prompt_ids, params, engine.eos_ids, engine.context_length, engine.decode)
        self._step: tuple[_Nodes, int, float, float] | None = None  # the planned step: nodes, cache length, times

    @property
    def finished(self) -> bool:
        return bool(self.out.finish)

    def prefill(self, should_stop: Callable[[], bool] | None = None) -> bool:
        """Reset the runner and feed the prompt (all but its last token); the drafter begins. True when
        should_stop stopped it (the generation is then cancelled)."""
        engine, out = self.engine, self.out
        if isinstance(engine.tree, DynamicTree) and engine.tree.budget is None and engine.budget.verify_cost is None:
            engine.budget.verify_cost = measure_verify_cost(engine.runner)  # once per engine, before the prefill
        engine.runner.reset(self.params)
        engine.budget.new_generation()
        stopped, features = engine.prefill(out.context[:-1], should_stop) if len(out.context) > 1 else (False, None)
        self.stats.prefill_time = time.perf_counter() - self.t_start
        if stopped:
            self.cancel()
        elif engine.drafter is not None:
            engine.drafter.begin(out.context, self.params, self.generator)
            if engine.features and len(out.context) > 1:
                engine.drafter.observe_features(features)
        return stopped

    def cancel(self) -> None:
        self.out.finish = "cancelled"

    def plan(self, max_draft: int | None = None) -> Forward:
        """Propose this step's nodes -> the forward that scores them. max_draft caps the drafted nodes
        (a batch's share of the step's positions; 0: plain decoding)."""
        engine, out = self.engine, self.out
        room = out.room()
        t0 = time.perf_counter()
        k = min(self.schedule.length, room - 1)  # a step commits accepted + 1
        if max_draft is not None:
            k = min(k, max_draft)
        proposal = engine.propose(out.context, k, room, max_draft)
        t1 = time.perf_counter()
        nodes = _Nodes.of(out.context[-1], proposal, room - 1)
        self._step = (nodes, engine.runner.length, t0, t1)
        return Forward(nodes.ids, nodes.tree, engine.features)

    def finish(self, scores: Scores) -> StepEvent:
        """Verify the planned step's nodes against their scores, commit the accepted path, tell the
        drafter and the statistics -> the step's StepEvent."""
        engine, stats = self.engine, self.stats
        nodes, base, t0, t1 = self._step
        self._step = None
        n = len(nodes.ids) - nodes.aux  # the pending token and the drafted nodes
        logits = scores.logits[:n] if nodes.aux else scores.logits
        result = verify(nodes.drafted, nodes.parents, nodes.draft_probs, logits, self.params, self.generator)
        if nodes.aux:
            result = replace(result, aux_logits=scores.logits[n:])
        path = [0] + [i + 1 for i in result.accepted_nodes]  # rows of the pending token and the accepted nodes
        engine.runner.commit(base, path)
        stats.observe(result, nodes.layout)
        if nodes.layout is not None and not nodes.free:
            engine.budget.observe_acceptance(nodes.layout, result.accepted_nodes)
        stats.draft_time += t1 - t0
        stats.verify_time += time.perf_counter() - t1
        self.schedule.observe(result)
        if engine.features:
            engine.drafter.observe_features(scores.features[path])
        if engine.drafter is not None:
            engine.drafter.observe(result)
        event = self.out.add(stats.steps, result)
        if stats.first_token_time is None and event.token_ids:
            stats.first_token_time = time.perf_counter() - self.t_start
        return event

    def result(self) -> Generation:
        """The Generation as it stands (finished: its final statistics)."""
        stats, out = self.stats, self.out
        stats.total_time = time.perf_counter() - self.t_start
        stats.new_tokens, stats.finish_reason = len(out.out), out.finish
        return Generation(text=out.text.text, token_ids=out.out, prompt_ids=self.prompt_ids, stats=stats,
                          finish_reason=out.finish, kinds=out.kinds)
