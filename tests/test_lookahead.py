"""Lookahead decoding (drafters/lookahead.py): the window's tree, greedy output equal to plain decoding
(tiny Llama and Gemma 3, transformers and the fast path in exact mode), and sampling lossless by the
chi-square tests of test_tree_distribution.py through the engine, with a planted wrong rule failing."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch

from conftest import loaded, tiny_gemma3, tiny_llama
from test_tree_distribution import V, Table, TableRunner, check, fails
from verispec import acceptance
from verispec.api import build_engine
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.engine import Engine
from verispec.errors import InvalidParameter
from verispec.tree import TreeLayout
from verispec.types import SamplingParams, StepResult

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [1, 2, 3, 1, 2]


def test_window_is_a_tree_with_one_token_per_position():
    d = LookaheadDrafter(window=3, ngram=3, candidates=2)
    d.begin([7, 8, 9], SamplingParams(), None)
    d.levels = [[10, 11, 12], [20, 21, 22]]
    d.pool = {5: {(6, 7): None, (6, 8): None, (9, 9): None}}
    p = d.propose([1, 5], k=4)
    # candidates: the three n-grams after 5, most recent first, merged on their shared first token
    assert p.tokens.tolist() == [9, 9, 6, 8, 7] and p.parents == [-1, 0, -1, 2, 2]
    n = len(p)
    assert p.aux_tokens.tolist() == [10, 11, 12, 20, 21, 22]
    assert p.aux_parents == [-1, n + 0, n + 1, n + 0, n + 1, n + 2]
    layout = TreeLayout.for_proposal(p.parents + p.aux_parents, n + 6)
    assert layout.depths[1 + n:].tolist() == [1, 2, 3, 2, 3, 4]  # level j, column i at depth i + j + 1
    # the top level's outputs are the Jacobi update; the full window yields one n-gram per column
    logits = torch.zeros(6, 40)
    logits[[3, 4, 5], [30, 31, 32]] = 1.0
    d.observe(StepResult(tokens=[1], num_accepted=0, num_drafted=n, aux_logits=logits))
    assert d.levels == [[20, 21, 22], [30, 31, 32]]
    assert list(d.pool[10]) == [(20, 30)] and list(d.pool[12]) == [(22, 32)]


def test_pool_keeps_the_most_recent_g_per_key():
    d = LookaheadDrafter(window=1, ngram=2, candidates=2)
    d.begin([4], SamplingParams(), None)
    for new in (5, 6, 7, 6):
        d.levels = [[4]]
        d.propose([0], 3)
        logits = torch.zeros(1, 10)
        logits[0, new] = 1.0
        d.observe(StepResult(tokens=[0], num_accepted=0, num_drafted=0, aux_logits=logits))
    assert list(d.pool[4]) == [(7,), (6,)]


TINY_PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [5, 9, 9, 2, 7, 5, 9], [3] * 12, list(range(20))]


@pytest.mark.parametrize("backend", ["hf", "fast"])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_tiny_models_greedy_equals_plain(family, backend):
    model = tiny_llama(vocab=32, seed=0) if family == "llama" else tiny_gemma3(vocab=32, seed=0)
    target = loaded(model)
    params = SamplingParams(max_new_tokens=40)
    accepted = 0
    for opts in ({}, {"lookahead_window": 6, "lookahead_ngram": 4, "lookahead_candidates": 6},
                 {"lookahead_window": 2, "lookahead_ngram": 2, "lookahead_candidates": 1}):
        for prompt in TINY_PROMPTS:
            plain = build_engine(target, "ar", backend=backend).generate(prompt, params)
            got = build_engine(target, "lookahead", backend=backend, **opts).generate(prompt, params)
            assert got.token_ids == plain.token_ids, (opts, prompt)
            accepted += got.stats.accepted
    assert accepted > 20  # random tiny models fall into loops, which the Jacobi window finds


def test_bad_options_are_rejected_with_one_line():
    target = loaded(tiny_llama(vocab=32, seed=0))
    for opts, flag in (({"lookahead_window": 0}, "lookahead_window must be >= 1"),
                       ({"lookahead_ngram": 1}, "lookahead_ngram must be >= 2"),
                       ({"lookahead_candidates": 99}, "lookahead_candidates must be <= 16")):
        with pytest.raises(InvalidParameter, match=flag) as e:
            build_engine(target, "lookahead", **opts)
        assert "\n" not in str(e.value)


def draw(engine: Engine, n: int, **kw):
    samples, accepted = [], 0
    for i in range(n):
        g = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=i, **kw))
        samples.append(tuple(g.token_ids))
        accepted += g.stats.accepted
    return samples, accepted


class PrefilledLookahead(LookaheadDrafter):
    """Starts with a pool of 3-grams for every first token, so the first step already verifies a trie of
    2-token candidates beside the window (a fresh pool has none before step N - 1)."""

    def begin(self, prompt, params, generator):
        super().begin(prompt, params, generator)
        self.pool = {t: OrderedDict.fromkeys([(1, 2), (2, 1), (2, 4)]) for t in range(V)}


CASES = {
    # name: (drafter class, W, N, G, sampling kwargs). N = 2 fills the pool after one step, so steps 2
    # verify several single-token candidates (siblings); the prefilled pool verifies 2-token tries
    "n2_siblings": (LookaheadDrafter, 3, 2, 3, dict(temperature=1.0)),
    "n3_trie_topk_topp": (PrefilledLookahead, 3, 3, 3, dict(temperature=0.7, top_k=4, top_p=0.9)),
}
N_SAMPLES = 12_000


@pytest.mark.parametrize("case", list(CASES))
def test_sampling_first_three_tokens_match_target(case):
    cls, w, n, g, kw = CASES[case]
    target = Table(seed=0)
    engine = Engine(TableRunner(target), set(), lambda ids: "", 1000, drafter=cls(window=w, ngram=n, candidates=g))
    samples, accepted = draw(engine, N_SAMPLES, **kw)
    check(samples, target.exact(PROMPT, SamplingParams(**kw)))
    assert accepted > N_SAMPLES // 20  # candidates were really verified, and some accepted


def test_sampling_without_the_residual_update_fails(monkeypatch):
    _, w, n, g, kw = CASES["n2_siblings"]
    target = Table(seed=0)
    right = acceptance._residual
    monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)  # wrong on purpose: p keeps rejected tokens
    engine = Engine(TableRunner(target), set(), lambda ids: "", 1000,
                    drafter=LookaheadDrafter(window=w, ngram=n, candidates=g))
    samples, _ = draw(engine, N_SAMPLES, **kw)
    assert right is not acceptance._residual
    assert fails(samples, target.exact(PROMPT, SamplingParams(**kw)))


def test_server_request_options():
    import openai

    from server_helpers import ServerThread, tiny_target
    from verispec.api import generate
    from verispec.server import ServerConfig, create_app

    target = tiny_target()
    chat = [{"role": "user", "content": "the cat sat on the mat and the cat sat on the"}]
    with ServerThread(create_app(target, ServerConfig(method="ar", default_max_tokens=16, max_tokens=32))) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny-words", messages=chat, max_tokens=16, temperature=0,
                                           extra_body={"verispec": {"method": "lookahead", "lookahead_window": 3,
                                                                    "lookahead_ngram": 2, "lookahead_candidates": 2}})
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-words", messages=chat, max_tokens=4,
                                           extra_body={"verispec": {"method": "lookahead", "lookahead_ngram": 1}})
    assert r.choices[0].message.content == generate(target, chat=chat, max_new_tokens=16).text
    assert r.model_extra["verispec"]["method"] == "lookahead"
    assert e.value.param == "verispec.lookahead_ngram" and "\n" not in e.value.message
