"""Drafters behind one Protocol, and the registry that maps a method name to a drafter factory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from verispec.drafters.base import DraftLengthSchedule, Drafter
from verispec.drafters.cross_vocab import CrossVocabularyDrafter, TextCodec
from verispec.drafters.draft_model import DraftModelDrafter, same_vocabulary
from verispec.drafters.ngram import NGramDrafter
from verispec.errors import InvalidParameter

if TYPE_CHECKING:  # verispec.options imports this registry (its method names)
    from verispec.options import SpeculationSettings


def _ar(target, settings: SpeculationSettings):
    """plain autoregressive decoding"""
    return None


def _ngram(target, settings: SpeculationSettings):
    """prompt lookup"""
    return NGramDrafter(max_n=settings.ngram.max_n, min_n=settings.ngram.min_n)


def _draft(target, settings: SpeculationSettings):
    """draft model, any vocabulary"""
    from verispec.models import LoadedModel, load_model

    draft = settings.models.draft
    if draft is None:
        raise InvalidParameter("method 'draft' needs a draft model; pass draft=... (CLI: --draft MODEL)")
    if not isinstance(draft, LoadedModel):
        draft = load_model(draft, dtype=target.dtype, device=target.device)
    from verispec.backends import make_runner

    # the draft's numerics only change proposals, never the output, so its fast runner skips exact mode
    same = same_vocabulary(target.tokenizer, draft.tokenizer)
    # another vocabulary: the draft holds the same text in its own tokens, at most its own context
    capacity = (target.context_length if same else draft.context_length) + 256
    runner = make_runner(draft.model, settings.backend.name, exact=False, capacity=capacity)
    if same:
        return DraftModelDrafter(draft.model, target.vocab_size, runner=runner)
    inner = DraftModelDrafter(draft.model, draft.vocab_size, runner=runner)  # proposes draft ids; cross_vocab.py maps them
    return CrossVocabularyDrafter(inner, TextCodec.of(target.tokenizer), TextCodec.of(draft.tokenizer),
                                  max_context=draft.context_length)


def _suffix(target, settings: SpeculationSettings):
    """suffix decoding"""
    from verispec.drafters.suffix import make_suffix_drafter

    s = settings.suffix
    return make_suffix_drafter(target.name, cache=s.cache, alpha=s.alpha, min_prob=s.min_prob, depth=s.depth)


def _lookahead(target, settings: SpeculationSettings):
    """lookahead decoding"""
    from verispec.drafters.lookahead import LookaheadDrafter

    s = settings.lookahead
    return LookaheadDrafter(window=s.window, ngram=s.ngram, candidates=s.candidates)


def _eagle(target, settings: SpeculationSettings):
    """EAGLE head"""
    from verispec.drafters.eagle import EagleDrafter

    return EagleDrafter.for_target(target, settings.models.head)  # a trained head folder; None = the shipped one


def _medusa(target, settings: SpeculationSettings):
    """Medusa heads"""
    from verispec.drafters.medusa import MedusaDrafter

    return MedusaDrafter.for_target(target, settings.models.head)


def _dflash(target, settings: SpeculationSettings):
    """DFlash block drafter"""
    from verispec.drafters.dflash import DFlashDrafter

    return DFlashDrafter.for_target(target, settings.models.head)  # a trained drafter folder; None = the shipped one


def _with_suffix(model: Callable) -> Callable:
    """The factory of `model`'s drafter behind suffix decoding's confident speculations (drafters/hybrid.py)."""

    def make(target, settings: SpeculationSettings):
        from verispec.drafters.hybrid import HybridDrafter

        return HybridDrafter(_suffix(target, settings), model(target, settings))

    make.__doc__ = f"suffix decoding where it is confident, else the {model.__doc__}"
    return make


# method name -> factory(target, settings) -> Drafter | None (None: plain autoregressive decoding); each
# factory reads its own part of the settings (verispec.options.SpeculationSettings: .ngram, .suffix, ...)
METHODS: dict[str, Callable] = {"ar": _ar, "ngram": _ngram, "draft": _draft}
METHODS["eagle"] = _eagle
METHODS["medusa"] = _medusa
METHODS["suffix"] = _suffix
METHODS["lookahead"] = _lookahead
METHODS["dflash"] = _dflash
for _model in ("eagle", "dflash", "medusa"):
    METHODS[f"suffix+{_model}"] = _with_suffix(METHODS[_model])


def make_drafter(method: str, target, settings: SpeculationSettings | None = None) -> Drafter | None:
    """The drafter of `method` for `target`, configured by `settings` (None: the defaults)."""
    if method not in METHODS:
        raise InvalidParameter(f"unknown method '{method}'; use one of {', '.join(METHODS)}")
    if settings is None:
        from verispec.options import SpeculationSettings

        settings = SpeculationSettings()
    return METHODS[method](target, settings)


__all__ = ["Drafter", "DraftLengthSchedule", "DraftModelDrafter", "CrossVocabularyDrafter", "TextCodec", "NGramDrafter", "METHODS", "make_drafter"]
