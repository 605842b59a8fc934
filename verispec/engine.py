"""The speculative decoding loop (plain decoding is the case with no drafter).

    prefill(prompt[:-1])                 the last committed token is always "pending": not yet in the cache
    repeat:
      proposal = drafter.propose(...)    k tokens, draft probabilities or None
      logits   = target([pending] + proposal)   ONE forward pass over k+1 positions
      result   = rule(proposal, logits)  accepted tokens + one recovered/bonus token
      crop the target cache to the accepted length; the drafter re-syncs on its next proposal
      stats.observe(result)

With a tree shape (tree.py) the drafter proposes a tree (Proposal.parents), the target scores all its
nodes in one forward under a tree attention mask (runner.forward_tree), tree_acceptance.py walks it, and
the accepted path's KV entries are compacted into contiguous slots (runner.compact). A proposal may
carry auxiliary nodes (lookahead decoding's window): they join the same forward and mask, are never
accepted, and their logits go back to the drafter in StepResult.aux_logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from verispec.acceptance import greedy_verify, speculative_verify
from verispec.drafters.base import DraftLengthSchedule, Drafter
from verispec.errors import InvalidParameter, InvalidPrompt
from verispec.metrics import SpecStats
from verispec.sampling import logits_to_probs, make_generator
from verispec.tree import (DynamicTree, RankAcceptance, StaticTree, TreeLayout, TreeShape, choose_budget,
                           measure_verify_cost, parse_tree)
from verispec.tree_acceptance import greedy_tree_verify, tree_speculative_verify
from verispec.types import Proposal, SamplingParams, StepResult

# prompt tokens per prefill chunk where the runner has no chunk size of its own (transformers)
PREFILL_CHUNK = 256


@dataclass
class StepEvent:
    """Tokens committed by one step, as they are streamed."""

    step: int
    token_ids: list[int]
    kinds: list[str]   # "accepted" | "recovered" | "bonus" per token
    text: str          # the new text these tokens made visible (may lag a token behind at UTF-8/stop boundaries)


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


class _TextTracker:
    """Incremental detokenization with stop strings: holds back text that may still become a stop
    string or an incomplete UTF-8 character."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]):
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.emitted = ""
        self.text = ""
        self.stopped = False

    def update(self, ids: list[int], final: bool) -> str:
        text = self.decode(ids)
        if self.stop:
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, self.stopped, final = text[:cut], True, True
        self.text = text
        visible = text if final else text.rstrip("\ufffd")
        if not final and self.hold:
            visible = visible[: max(len(visible) - self.hold, len(self.emitted))]
        if not visible.startswith(self.emitted):
            return ""  # detokenization rewrote earlier text; wait for it to settle
        delta = visible[len(self.emitted):]
        self.emitted = visible
        return delta


class Engine:
    """Runs generations for one target (runner) and one optional drafter."""

    def __init__(self, runner, eos_ids: set[int], decode: Callable[[list[int]], str], context_length: int,
                 drafter: Drafter | None = None, draft_length: int = 5, adaptive: bool = False,
                 max_draft_length: int = 16, method: str | None = None, device: torch.device | str = "cpu",
                 tree: TreeShape | str | None = None, verify_cost: dict[int, float] | None = None):
        if not isinstance(draft_length, int) or draft_length < 1:
            raise InvalidParameter(f"draft length must be an integer >= 1, got {draft_length}")
        self.tree = parse_tree(tree)
        if self.tree is not None:
            if drafter is None:
                raise InvalidParameter("a tree needs a drafter; choose a method other than 'ar'")
            if not callable(getattr(drafter, "propose_tree", None)):
                raise InvalidParameter(f"the '{drafter.name}' drafter cannot make trees; drop the tree option")
            if not callable(getattr(runner, "forward_tree", None)) or not callable(getattr(runner, "compact", None)):
                raise InvalidParameter("this target backend cannot verify trees; drop the tree option")
            for part in (runner, drafter):
                if callable(getattr(part, "check_tree_support", None)):
                    part.check_tree_support()
        # hardware-aware budget (DynamicTree(budget=None)): cost curve measured once, acceptance by rank
        # learned across generations
        self.verify_cost = verify_cost
        self.rank_acceptance = RankAcceptance()
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
        "fast"; runner_options go to verispec.fast.FastRunner (exact, compile, ...)."""
        from verispec.fast import make_runner

        # slack past the context for tree nodes that share the last positions
        if runner is None:  # else: a runner reused from an earlier engine (it is reset per generation)
            # the loaded model's weights format and its file's own weights (fast/quant.py), unless overridden
            opts = {"weights": getattr(target, "weights", "auto"), "weight_source": getattr(target, "weight_source", None),
                    **{k: v for k, v in (runner_options or {}).items() if v is not None or k != "weights"}}
            runner = make_runner(target.model, backend, capacity=target.context_length + 256, **opts)
        return cls(runner, target.eos_token_ids, target.decode, target.context_length,
                   drafter=drafter, device=target.device, **kwargs)

    def tree_shape(self, max_depth: int) -> TreeShape:
        """The tree to ask the drafter for this step, cut to `max_depth` (the room left)."""
        tree = self.tree
        if isinstance(tree, StaticTree):
            return tree.truncated(max_depth) if tree.depth > max_depth else tree
        budget = tree.budget
        if budget is None:
            budget = choose_budget(self.rank_acceptance.profile(), self.verify_cost, max_depth=tree.depth).budget
        return DynamicTree(budget=budget, topk=tree.topk, depth=min(tree.depth, max_depth))

    def verify_tree(self, proposal: Proposal, layout: TreeLayout, logits: torch.Tensor, params: SamplingParams,
                    generator) -> StepResult:
        if params.greedy:
            return greedy_tree_verify(proposal.tokens, proposal.parents, logits)
        probs = logits_to_probs(logits, params)
        return tree_speculative_verify(proposal.tokens, proposal.parents, proposal.draft_probs, probs, generator)

    def verify(self, proposal, logits: torch.Tensor, params: SamplingParams, generator) -> StepResult:
        draft = proposal.tokens if proposal is not None else torch.empty(0, dtype=torch.long)
        if params.greedy:
            return greedy_verify(draft, logits)
        probs = logits_to_probs(logits, params)
        return speculative_verify(draft, proposal.draft_probs if proposal is not None else None, probs, generator)

    def prefill(self, ids: list[int], should_stop: Callable[[], bool] | None = None):
        """Feed `ids` into the target's cache -> (stopped, the features of every position or None).

        With should_stop, the prompt goes in chunks and should_stop() is asked between them (True: stop
        now), so a timeout or a gone client stops a long prompt within one chunk. The chunks are the
        runner's own prefill passes (FastRunner.prefill_chunk), so the cache gets the same values as one
        call gives; without should_stop it is one call, as it always was.
        """
        chunk = len(ids) if should_stop is None else getattr(self.runner, "prefill_chunk", None) or PREFILL_CHUNK
        features = []
        for start in range(0, len(ids), chunk):
            if start and should_stop():
                return True, None
            self.runner.forward(ids[start:start + chunk], last_only=True)
            if self.runner_features():
                features.append(self.runner.last_features)
        if not features:
            return False, None
        return False, features[0] if len(features) == 1 else torch.cat(features, dim=0)

    def runner_features(self) -> bool:
        return bool(getattr(self.runner, "feature_layers", None))

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               should_stop: Callable[[], bool] | None = None) -> Iterator[StepEvent]:
        """Yield a StepEvent per verification step; the finished Generation is then in self.last.

        should_stop (a server's deadline or disconnect check) is asked between prefill chunks and
        between steps; when it returns True the generation ends with finish_reason "cancelled".
        """
        if not prompt_ids:
            raise InvalidPrompt("the prompt is empty; give some text")
        if len(prompt_ids) >= self.context_length:
            raise InvalidPrompt(f"the prompt has {len(prompt_ids)} tokens but the model takes at most "
                                f"{self.context_length}; shorten it")
        t_start = time.perf_counter()
        stats = SpecStats(method=self.method, prompt_tokens=len(prompt_ids),
                          tree=self.tree.describe() if self.tree is not None else "")
        generator = make_generator(params.seed, self.device)
        schedule = DraftLengthSchedule(self.draft_length, self.adaptive, self.max_draft_length)
        text = _TextTracker(self.decode, params.stop)
        context = list(prompt_ids)
        out: list[int] = []
        kinds: list[str] = []
        finish = ""

        if isinstance(self.tree, DynamicTree) and self.tree.budget is None and self.verify_cost is None:
            self.verify_cost = measure_verify_cost(self.runner)  # once per engine, before the prefill
        self.runner.reset()
        if hasattr(self.runner, "prepare"):  # fast path: exact mode follows greedy decoding
            self.runner.prepare(params)
        # drafters that read the target's hidden features (EAGLE, Medusa) get them for every committed
        # position whose KV entry the target cache holds: the prefill, then each step's accepted path
        features = bool(getattr(self.drafter, "needs_target_features", False))
        if features or hasattr(self.runner, "feature_layers"):
            if features and not hasattr(self.runner, "feature_layers"):
                raise InvalidParameter(f"the '{self.drafter.name}' drafter needs the target's hidden features, "
                                       "which this backend does not expose")
            self.runner.feature_layers = tuple(self.drafter.feature_layers) if features else None
        prompt_features = None
        if len(context) > 1:
            stopped, prompt_features = self.prefill(context[:-1], should_stop)
            if stopped:
                finish = "cancelled"
        stats.prefill_time = time.perf_counter() - t_start
        if self.drafter is not None and not finish:
            self.drafter.begin(context, params, generator)
            if features and len(context) > 1:
                self.drafter.observe_features(prompt_features)

        while not finish:
            if should_stop is not None and should_stop():
                finish = "cancelled"
                break
            room = min(params.max_new_tokens - len(out), self.context_length - len(context))
            k = min(schedule.length, room - 1)  # a step commits accepted + 1 tokens
            t0 = time.perf_counter()
            if self.drafter is None or k <= 0:
                proposal = None
            elif self.tree is not None:
                proposal = self.drafter.propose_tree(context, self.tree_shape(room - 1))
            else:
                proposal = self.drafter.propose(context, k)
            aux = proposal.aux_tokens.tolist() if proposal is not None and proposal.aux_tokens is not None else []
            if proposal is not None and len(proposal) == 0 and not aux:
                proposal = None
            t1 = time.perf_counter()
            draft = proposal.tokens.tolist() if proposal is not None else []
            base = self.runner.length
            if proposal is not None and (proposal.parents is not None or aux):
                layout = TreeLayout.for_proposal(proposal.parents, len(proposal))
                if int(layout.depths.max()) > room - 1:
                    raise InvalidParameter(f"the drafter proposed a tree deeper than the {room - 1} tokens asked for")
                # auxiliary nodes ride in the same forward (after the drafted ones, so their rows come last)
                # and are dropped from the cache with the rejected nodes
                full = layout if not aux else TreeLayout.for_proposal(
                    (proposal.parents if proposal.parents is not None else list(range(-1, len(draft) - 1)))
                    + list(proposal.aux_parents), len(draft) + len(aux))
                logits = self.runner.forward_tree([context[-1]] + draft + aux, full.mask, full.depths)
                result = self.verify_tree(proposal, layout, logits[: len(draft) + 1], params, generator)
                if aux:
                    result = replace(result, aux_logits=logits[len(draft) + 1:])
                self.runner.compact(base, [0] + [i + 1 for i in result.accepted_nodes])
                stats.observe_tree(result, layout)
                for offered, rank in layout.walk_ranks(result.accepted_nodes):
                    self.rank_acceptance.observe(offered, rank)
            else:
                logits = self.runner.forward([context[-1]] + draft)
                result = self.verify(proposal, logits, params, generator)
                self.runner.crop(base + 1 + result.num_accepted)
                stats.observe(result)
            t2 = time.perf_counter()
            stats.draft_time += t1 - t0
            stats.verify_time += t2 - t1
            schedule.observe(result)
            if features:  # rows of the pending token and the accepted nodes, in path order
                rows = [0] + ([i + 1 for i in result.accepted_nodes] if proposal is not None and proposal.parents
                              is not None else list(range(1, 1 + result.num_accepted)))
                self.drafter.observe_features(self.runner.last_features[rows])
            if self.drafter is not None:
                self.drafter.observe(result)

            new_ids, new_kinds = [], []
            for tok, kind in zip(result.tokens, result.kinds()):
                if tok in self.eos_ids:
                    finish = "stop"
                    break
                new_ids.append(tok)
                new_kinds.append(kind)
                if len(out) + len(new_ids) >= params.max_new_tokens:
                    finish = "length"
                    break
            context.extend(result.tokens)
            out.extend(new_ids)
            kinds.extend(new_kinds)
            if not finish and len(context) >= self.context_length:
                finish = "length"
            delta = text.update(out, final=bool(finish))
            if text.stopped:
                finish = "stop"
                delta += text.update(out, final=True)
            if stats.first_token_time is None and new_ids:
                stats.first_token_time = time.perf_counter() - t_start
            yield StepEvent(step=stats.steps, token_ids=new_ids, kinds=new_kinds, text=delta)

        stats.total_time = time.perf_counter() - t_start
        stats.new_tokens = len(out)
        stats.finish_reason = finish
        self.last = Generation(text=text.text, token_ids=out, prompt_ids=list(prompt_ids), stats=stats,
                               finish_reason=finish, kinds=kinds)

    def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        for _ in self.stream(prompt_ids, params):
            pass
        assert self.last is not None
        return self.last
