"""The loop's contract: stop conditions, streaming, statistics, reproducible seeds."""

import pytest
import torch

from conftest import NumberTokenizer, loaded, tiny_llama
from table_lm import TableDrafter, TableLM
from verispec.api import build_engine
from verispec.drafters import NGramDrafter
from verispec.drafters.ngram import find_continuation
from verispec.engine import Engine
from verispec.types import SamplingParams


def test_ngram_finds_latest_match_longest_first():
    ctx = [1, 2, 3, 9, 1, 2, 4, 7, 5, 1, 2]
    assert find_continuation(ctx, 3, max_n=2) == [4, 7, 5]   # latest "1 2" is followed by 4 7 5
    assert find_continuation([5, 6, 7, 5, 6, 8, 6], 2, max_n=3) == [8, 6]  # falls back to n=1: latest "6"
    assert find_continuation([1, 2, 3], 4) == []


def test_max_new_tokens_and_stats_add_up():
    target = loaded(tiny_llama())
    g = build_engine(target, "ngram", draft_length=3).generate([3] * 10, SamplingParams(max_new_tokens=17))
    s = g.stats
    assert len(g.token_ids) == 17 and g.finish_reason == "length"
    assert s.new_tokens == 17 and s.committed >= 17
    assert s.committed == s.accepted + s.steps  # each step: accepted drafts + one target token
    assert sum(s.accepted_by_position) == s.accepted
    assert s.drafted_by_position[0] >= s.drafted_by_position[-1]
    assert 0 <= s.acceptance_rate <= 1 and s.mean_accepted_length == s.committed / s.steps


def test_eos_stops_and_is_not_emitted():
    target = TableLM(6, seed=0)
    plain = Engine(target, set(), lambda ids: "", 1000).generate([1, 2], SamplingParams(max_new_tokens=20))
    eos = plain.token_ids[5]
    cut = plain.token_ids.index(eos)
    for drafter in (None, NGramDrafter(), TableDrafter(TableLM(6, seed=3))):
        g = Engine(target, {eos}, lambda ids: "", 1000, drafter=drafter).generate([1, 2], SamplingParams(max_new_tokens=20))
        assert g.token_ids == plain.token_ids[:cut] and g.finish_reason == "stop"


def test_stop_string_truncates_text_and_stream_matches_final_text():
    target = loaded(tiny_llama())
    plain = build_engine(target, "ar").generate([1, 2, 3], SamplingParams(max_new_tokens=30))
    words = plain.text.split()
    stop = " ".join(words[5:7])
    g_stream = build_engine(target, "ngram")
    streamed = "".join(e.text for e in g_stream.stream([1, 2, 3], SamplingParams(max_new_tokens=30, stop=(stop,))))
    g = g_stream.last
    assert g.finish_reason == "stop"
    assert stop not in g.text and plain.text.startswith(g.text)
    assert g.text == plain.text[: plain.text.find(stop)]
    assert streamed == g.text


def test_stream_kinds_follow_acceptance():
    target = loaded(tiny_llama())
    engine = build_engine(target, "draft", draft=target, draft_length=3)
    events = list(engine.stream([1, 2, 3, 4], SamplingParams(max_new_tokens=12)))
    # the target drafting for itself: every step is 3 accepted + 1 bonus
    assert events[0].kinds == ["accepted", "accepted", "accepted", "bonus"]
    assert sum(len(e.token_ids) for e in events) == 12


def test_seeded_sampling_is_reproducible_and_seeds_differ():
    target = loaded(tiny_llama())
    for method in ("ar", "ngram", "draft"):
        opts = {"draft": loaded(tiny_llama(seed=2))} if method == "draft" else {}
        runs = [build_engine(target, method, **opts).generate([1, 2, 3], SamplingParams(temperature=1.0, seed=s, max_new_tokens=20)).token_ids
                for s in (7, 7, 8)]
        assert runs[0] == runs[1] and runs[0] != runs[2]


def test_adaptive_draft_length_grows_after_full_accepts():
    target = loaded(tiny_llama())
    engine = build_engine(target, "draft", draft=target, draft_length=2, adaptive=True, max_draft_length=8)
    g = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=40))
    assert len(g.stats.drafted_by_position) == 8  # grew 2 -> 4 -> 6 -> 8


def test_context_window_is_respected():
    target = loaded(tiny_llama())  # max_position_embeddings = 512
    g = build_engine(target, "ngram").generate([1] * 500, SamplingParams(max_new_tokens=100))
    assert g.finish_reason == "length" and len(g.token_ids) == 12
