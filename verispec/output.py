"""A generation's committed tokens and their text, and the rules that end it: EOS, max_new_tokens, the
context window, stop strings (held back while they may still complete)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from verispec.types import SamplingParams, StepResult


@dataclass
class StepEvent:
    """Tokens committed by one step, as they are streamed."""

    step: int
    token_ids: list[int]
    kinds: list[str]   # "accepted" | "recovered" | "bonus" per token
    text: str          # the new text these tokens made visible (may lag a token behind at UTF-8/stop boundaries)


class TextTracker:
    """Incremental detokenization with stop strings: holds back text that may still become a stop
    string or an incomplete UTF-8 character.

    The text is decode(all ids), but decoding them all at every step costs time in the output's length
    (the tokenizer's call and its Python-side checks: a long answer's steps got slower and slower). So
    the text of the ids before `cut` is kept, and a step decodes only the ids after it: the cut moves
    forward, WINDOW ids behind the end, where decoding the two sides apart gives the same text as
    decoding them together (checked when it moves: an incomplete UTF-8 character or a tokenizer that
    joins pieces with spaces or strips a leading one leaves it where it is, and then a step decodes
    everything after the old cut, as before)."""

    WINDOW = 32

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...], windowed: bool = True):
        """windowed False: every step decodes every id (the reference the windowed text must equal; the
        cost it saves is measured by dev/engine_overhead.py)."""
        self.decode, self.stop = decode, stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.emitted = ""
        self.text = ""
        self.stopped = False
        self.cut, self.head = 0, ""  # ids[:cut] decode to head
        self.next_try = 2 * self.WINDOW if windowed else float("inf")  # where moving the cut is tried next

    def _decode(self, ids: list[int]) -> str:
        tail = self.decode(ids[self.cut:])
        if len(ids) >= self.next_try:
            self.next_try = len(ids) + self.WINDOW
            at = len(ids) - self.WINDOW
            head = self.decode(ids[self.cut:at])
            if not head.endswith("\ufffd") and tail.startswith(head) and tail[len(head):] == self.decode(ids[at:]):
                self.cut, self.head, tail = at, self.head + head, tail[len(head):]
        return self.head + tail

    def update(self, ids: list[int], final: bool) -> str:
        text = self._decode(ids)
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


class Output:
    """A generation's committed tokens and the rules that end it: EOS, max_new_tokens, the context
    window, stop strings (through the text tracker)."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int], context_length: int,
                 decode: Callable[[list[int]], str]):
        self.context, self.out, self.kinds, self.finish = list(prompt_ids), [], [], ""
        self.params, self.eos_ids, self.context_length = params, eos_ids, context_length
        self.text = TextTracker(decode, params.stop)

    def room(self) -> int:
        """Tokens the generation may still commit."""
        return min(self.params.max_new_tokens - len(self.out), self.context_length - len(self.context))

    def add(self, step: int, result: StepResult) -> StepEvent:
        """Commit a step's tokens and decide whether the generation ends here."""
        new_ids, new_kinds = [], []
        for tok, kind in zip(result.tokens, result.kinds()):
            if tok in self.eos_ids:
                self.finish = "stop"
                break
            new_ids.append(tok)
            new_kinds.append(kind)
            if len(self.out) + len(new_ids) >= self.params.max_new_tokens:
                self.finish = "length"
                break
        self.context.extend(result.tokens)
        self.out.extend(new_ids)
        self.kinds.extend(new_kinds)
        if not self.finish and len(self.context) >= self.context_length:
            self.finish = "length"
        delta = self.text.update(self.out, final=bool(self.finish))
        if self.text.stopped:
            self.finish = "stop"
            delta += self.text.update(self.out, final=True)
        return StepEvent(step=step, token_ids=new_ids, kinds=new_kinds, text=delta)
