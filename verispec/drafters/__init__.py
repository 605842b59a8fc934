"""Drafters behind one Protocol, and the registry that maps a method name to a drafter factory."""

from __future__ import annotations

from typing import Callable

from verispec.drafters.base import DraftLengthSchedule, Drafter
from verispec.drafters.cross_vocab import CrossVocabularyDrafter, TextCodec
from verispec.drafters.draft_model import DraftModelDrafter, same_vocabulary
from verispec.drafters.ngram import NGramDrafter
from verispec.errors import InvalidParameter


def _ar(target, **_):
    """plain autoregressive decoding"""
    return None


def _ngram(target, ngram_max: int = 3, ngram_min: int = 1, **_):
    """prompt lookup"""
    return NGramDrafter(max_n=ngram_max, min_n=ngram_min)


def _draft(target, draft=None, backend: str = "hf", **_):
    """draft model, any vocabulary"""
    from verispec.models import LoadedModel, load_model

    if draft is None:
        raise InvalidParameter("method 'draft' needs a draft model; pass draft=... (CLI: --draft MODEL)")
    if not isinstance(draft, LoadedModel):
        draft = load_model(draft, dtype=target.dtype, device=target.device)
    from verispec.backends import make_runner

    # the draft's numerics only change proposals, never the output, so its fast runner skips exact mode
    same = same_vocabulary(target.tokenizer, draft.tokenizer)
    # another vocabulary: the draft holds the same text in its own tokens, at most its own context
    capacity = (target.context_length if same else draft.context_length) + 256
    runner = make_runner(draft.model, backend, exact=False, capacity=capacity)
    if same:
        return DraftModelDrafter(draft.model, target.vocab_size, runner=runner)
    inner = DraftModelDrafter(draft.model, draft.vocab_size, runner=runner)  # proposes draft ids; cross_vocab.py maps them
    return CrossVocabularyDrafter(inner, TextCodec.of(target.tokenizer), TextCodec.of(draft.tokenizer),
                                  max_context=draft.context_length)


def _suffix(target, suffix_cache="global", suffix_alpha: float = 1.0, suffix_min_prob: float = 0.1,
            suffix_depth: int = 24, **_):
    """suffix decoding"""
    from verispec.drafters.suffix import make_suffix_drafter

    return make_suffix_drafter(target.name, cache=suffix_cache, alpha=suffix_alpha, min_prob=suffix_min_prob,
                               depth=suffix_depth)


def _lookahead(target, lookahead_window: int = 2, lookahead_ngram: int = 3, lookahead_candidates: int = 2, **_):
    """lookahead decoding"""
    from verispec.drafters.lookahead import LookaheadDrafter

    return LookaheadDrafter(window=lookahead_window, ngram=lookahead_ngram, candidates=lookahead_candidates)


def _eagle(target, head=None, **_):
    """EAGLE head"""
    from verispec.drafters.eagle import EagleDrafter

    return EagleDrafter.for_target(target, head)  # head: a trained head folder; None = the shipped one


def _medusa(target, head=None, **_):
    """Medusa heads"""
    from verispec.drafters.medusa import MedusaDrafter

    return MedusaDrafter.for_target(target, head)


def _dflash(target, head=None, **_):
    """block drafter"""
    from verispec.drafters.dflash import DFlashDrafter

    return DFlashDrafter.for_target(target, head)  # head: a trained drafter folder; None = the shipped one


def _with_suffix(model: Callable) -> Callable:
    """The factory of `model`'s drafter behind suffix decoding's confident speculations (drafters/hybrid.py)."""

    def make(target, **options):
        from verispec.drafters.hybrid import HybridDrafter

        return HybridDrafter(_suffix(target, **options), model(target, **options))

    make.__doc__ = f"suffix decoding where it is confident, else the {model.__doc__}"
    return make


# method name -> factory(target, **options) -> Drafter | None (None: plain autoregressive decoding)
METHODS: dict[str, Callable] = {"ar": _ar, "ngram": _ngram, "draft": _draft}
METHODS["eagle"] = _eagle
METHODS["medusa"] = _medusa
METHODS["suffix"] = _suffix
METHODS["lookahead"] = _lookahead
METHODS["dflash"] = _dflash
for _model in ("eagle", "dflash", "medusa"):
    METHODS[f"suffix+{_model}"] = _with_suffix(METHODS[_model])


def make_drafter(method: str, target, **options) -> Drafter | None:
    if method not in METHODS:
        raise InvalidParameter(f"unknown method '{method}'; use one of {', '.join(METHODS)}")
    return METHODS[method](target, **options)


__all__ = ["Drafter", "DraftLengthSchedule", "DraftModelDrafter", "CrossVocabularyDrafter", "TextCodec", "NGramDrafter", "METHODS", "make_drafter"]
