"""The speculative decoding loop (plain decoding is the case with no drafter).

    prefill(prompt[:-1])                 the last committed token is always "pending": not yet in the cache
    repeat:
      proposal = drafter.propose(...)    k tokens, draft probabilities or None
      logits   = target([pending] + proposal)   ONE forward pass over k+1 positions
      result   = rule(proposal, logits)  accepted tokens + one recovered/bonus token
      crop the target cache to the accepted length; the drafter re-syncs on its next proposal
      stats.observe(result)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from verispec.acceptance import greedy_verify, speculative_verify
from verispec.drafters.base import DraftLengthSchedule, Drafter
from verispec.errors import InvalidParameter, InvalidPrompt
from verispec.metrics import SpecStats
from verispec.sampling import logits_to_probs, make_generator
from verispec.types import SamplingParams, StepResult


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
    finish_reason: str  # "stop" (EOS or a stop string), "length" (max_new_tokens or context window)
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
                 max_draft_length: int = 16, method: str | None = None, device: torch.device | str = "cpu"):
        if not isinstance(draft_length, int) or draft_length < 1:
            raise InvalidParameter(f"draft length must be an integer >= 1, got {draft_length}")
        self.runner, self.eos_ids, self.decode = runner, set(eos_ids), decode
        self.context_length = context_length
        self.drafter = drafter
        self.draft_length, self.adaptive, self.max_draft_length = draft_length, adaptive, max_draft_length
        self.method = method or (drafter.name if drafter is not None else "ar")
        self.device = torch.device(device)
        self.last: Generation | None = None

    @classmethod
    def for_model(cls, target, drafter: Drafter | None = None, **kwargs) -> "Engine":
        from verispec.runner import HFRunner

        return cls(HFRunner(target.model), target.eos_token_ids, target.decode, target.context_length,
                   drafter=drafter, device=target.device, **kwargs)

    def verify(self, proposal, logits: torch.Tensor, params: SamplingParams, generator) -> StepResult:
        draft = proposal.tokens if proposal is not None else torch.empty(0, dtype=torch.long)
        if params.greedy:
            return greedy_verify(draft, logits)
        probs = logits_to_probs(logits, params)
        return speculative_verify(draft, proposal.draft_probs if proposal is not None else None, probs, generator)

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepEvent]:
        """Yield a StepEvent per verification step; the finished Generation is then in self.last."""
        if not prompt_ids:
            raise InvalidPrompt("the prompt is empty; give some text")
        if len(prompt_ids) >= self.context_length:
            raise InvalidPrompt(f"the prompt has {len(prompt_ids)} tokens but the model takes at most "
                                f"{self.context_length}; shorten it")
        t_start = time.perf_counter()
        stats = SpecStats(method=self.method, prompt_tokens=len(prompt_ids))
        generator = make_generator(params.seed, self.device)
        schedule = DraftLengthSchedule(self.draft_length, self.adaptive, self.max_draft_length)
        text = _TextTracker(self.decode, params.stop)
        context = list(prompt_ids)
        out: list[int] = []
        kinds: list[str] = []
        finish = ""

        self.runner.reset()
        if len(context) > 1:
            self.runner.forward(context[:-1], last_only=True)
        stats.prefill_time = time.perf_counter() - t_start
        if self.drafter is not None:
            self.drafter.begin(context, params, generator)

        while not finish:
            room = min(params.max_new_tokens - len(out), self.context_length - len(context))
            k = min(schedule.length, room - 1)  # a step commits accepted + 1 tokens
            t0 = time.perf_counter()
            proposal = self.drafter.propose(context, k) if (self.drafter is not None and k > 0) else None
            if proposal is not None and len(proposal) == 0:
                proposal = None
            t1 = time.perf_counter()
            draft = proposal.tokens.tolist() if proposal is not None else []
            base = self.runner.length
            logits = self.runner.forward([context[-1]] + draft)
            result = self.verify(proposal, logits, params, generator)
            self.runner.crop(base + 1 + result.num_accepted)
            t2 = time.perf_counter()
            stats.draft_time += t1 - t0
            stats.verify_time += t2 - t1
            stats.observe(result)
            schedule.observe(result)
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
