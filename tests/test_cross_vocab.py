"""A draft model with another vocabulary (drafters/cross_vocab.py): lossless by string-level exact match.

Toy vocabularies over the letters a, b, c whose tokenizations differ (greedy longest match): the target
knows "ab" and "ca", the draft knows "bc", "ba" and "cc", so a drafted text is cut into other tokens
for the target than the draft used. The target and the draft are table models (table_lm.py) over
their own ids. Sampling: the engine's first 3 tokens are distributed exactly as the target's, by the
chi-square tests of test_distribution.py (N samples at level 1e-3); greedy: token for token equal to
plain decoding. Then the registry path with tiny transformers models of two vocabulary sizes.
"""

from __future__ import annotations

import pytest
import torch

from conftest import loaded, tiny_llama
from stats_util import chi_square_pvalue, marginals
from table_lm import TableLM
from test_distribution import ALPHA, N, check, draw
from verispec import acceptance
from verispec.api import build_engine
from verispec.drafters import CrossVocabularyDrafter, DraftModelDrafter, TextCodec
from verispec.engine import Engine
from verispec.errors import InvalidParameter
from verispec.types import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

TARGET_PIECES = ["a", "b", "c", "ab", "ca"]
DRAFT_PIECES = ["a", "b", "c", "bc", "ba", "cc"]
PROMPT = [3, 2, 0, 1]  # "ab" "c" "a" "b": not how the target's own tokenizer would cut "abcab"


def codec(pieces: list[str]) -> TextCodec:
    """Greedy longest-match tokenizer over `pieces` (single letters always present)."""
    index = {p: i for i, p in enumerate(pieces)}
    longest = max(map(len, pieces))

    def encode(text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            n = next(n for n in range(min(longest, len(text) - i), 0, -1) if text[i:i + n] in index)
            out.append(index[text[i:i + n]])
            i += n
        return out

    return TextCodec(encode=encode, decode=lambda ids: "".join(pieces[i] for i in ids))


def cross_drafter(draft_model: TableLM, draft_pieces=DRAFT_PIECES) -> CrossVocabularyDrafter:
    inner = DraftModelDrafter(None, draft_model.vocab, runner=draft_model)
    return CrossVocabularyDrafter(inner, codec(TARGET_PIECES), codec(draft_pieces))


def test_toy_tokenizations_differ():
    t, d = codec(TARGET_PIECES), codec(DRAFT_PIECES)
    assert t.encode("abcab") == [3, 4, 1] and d.encode("abcab") == [0, 3, 0, 1]
    assert t.encode("bab") == [1, 3] and d.encode("bab") == [4, 1]
    assert t.decode(PROMPT) == "abcab"


CASES = {
    # name: (draft table seed, draft length, sampling kwargs)
    "t1_k3": (3, 3, dict(temperature=1.0)),
    "topk_topp_k2": (4, 2, dict(temperature=0.8, top_k=3, top_p=0.9)),
    "k6": (5, 6, dict(temperature=1.3)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_three_tokens_match_target(case):
    seed, k, kw = CASES[case]
    target = TableLM(len(TARGET_PIECES), seed=0)
    engine = Engine(target, set(), lambda ids: "", 1000, drafter=cross_drafter(TableLM(len(DRAFT_PIECES), seed=seed)),
                    draft_length=k)
    samples = draw(engine, N, prompt=PROMPT, **kw)
    check(samples, target.exact_distribution(PROMPT, SamplingParams(**kw)))
    assert engine.last.stats.drafted > 0


def _oracle_draft(target: TableLM, perm: list[int]) -> TableLM:
    """The target's own table over permuted ids: the same model seen through another vocabulary."""
    draft = TableLM(target.vocab)
    inv = torch.tensor(perm)
    draft.table = torch.empty_like(target.table)
    draft.table[inv[:, None, None], inv[None, :, None], inv[None, None, :]] = target.table
    return draft


def test_sampling_with_the_target_behind_another_vocabulary_and_a_wrong_rule_fails(monkeypatch):
    """Lossless with a draft that agrees with the target (many acceptances), and the samples have the
    power to catch a rule without the residual update."""
    target = TableLM(3, seed=0)
    perm = [2, 0, 1]
    letters = ["a", "b", "c"]
    draft_pieces = [None] * 3
    for i, j in enumerate(perm):
        draft_pieces[j] = letters[i]  # draft id perm[i] spells target id i
    inner = DraftModelDrafter(None, 3, runner=_oracle_draft(target, perm))
    drafter = CrossVocabularyDrafter(inner, codec(letters), codec(draft_pieces))
    engine = Engine(target, set(), lambda ids: "", 1000, drafter=drafter, draft_length=3)
    kw = dict(temperature=1.0)
    prompt = [0, 1, 2, 0]
    exact = target.exact_distribution(prompt, SamplingParams(**kw))
    check(draw(engine, N, prompt=prompt, **kw), exact)
    accepted = sum(engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=s, **kw)).stats.accepted
                   for s in range(50))
    assert accepted > 25

    right = acceptance.speculative_verify

    def no_residual(draft, draft_probs, target_probs, generator):
        res = right(draft, draft_probs, target_probs, generator)
        if res.num_accepted < res.num_drafted:  # wrong on purpose: p instead of p without the rejected token
            res.tokens[-1] = int(torch.multinomial(target_probs[res.num_accepted], 1, generator=generator))
        return res

    monkeypatch.setattr("verispec.acceptance.speculative_verify", no_residual)
    wrong = draw(engine, N, prompt=prompt, **kw)
    assert min(chi_square_pvalue(wrong, exact), chi_square_pvalue(*marginals(wrong, exact, 0))) < ALPHA


def test_greedy_equals_plain_and_the_oracle_is_fully_accepted():
    target = TableLM(3, seed=1)
    perm = [1, 2, 0]
    letters = ["a", "b", "c"]
    draft_pieces = [None] * 3
    for i, j in enumerate(perm):
        draft_pieces[j] = letters[i]
    params = SamplingParams(max_new_tokens=20)
    plain = Engine(target, set(), lambda ids: "", 1000).generate([0, 1], params).token_ids
    oracle = CrossVocabularyDrafter(DraftModelDrafter(None, 3, runner=_oracle_draft(target, perm)), codec(letters),
                                    codec(draft_pieces))
    got = Engine(target, set(), lambda ids: "", 1000, drafter=oracle, draft_length=4).generate([0, 1], params)
    assert got.token_ids == plain and got.stats.acceptance_rate == 1.0
    for seed in range(4):
        t5 = TableLM(len(TARGET_PIECES), seed=seed)
        prompt = [seed % 5, 3, 4]
        plain = Engine(t5, set(), lambda ids: "", 1000).generate(prompt, params).token_ids
        engine = Engine(t5, set(), lambda ids: "", 1000, drafter=cross_drafter(TableLM(6, seed=10 + seed)), draft_length=3)
        assert engine.generate(prompt, params).token_ids == plain


@pytest.mark.parametrize("backend", ["hf", "fast"])
def test_registry_takes_a_draft_model_with_another_vocabulary(backend):
    target = loaded(tiny_llama(vocab=32, seed=0))
    draft = loaded(tiny_llama(vocab=40, seed=1), name="tiny-40")
    engine = build_engine(target, "draft", draft=draft, draft_length=3, backend=backend)
    assert isinstance(engine.drafter, CrossVocabularyDrafter)
    prompt = [1, 5, 9, 2, 7]
    params = SamplingParams(max_new_tokens=24)
    plain = build_engine(target, "ar", backend=backend).generate(prompt, params)
    got = engine.generate(prompt, params)
    assert got.token_ids == plain.token_ids and got.stats.drafted > 0
    with pytest.raises(InvalidParameter, match="cannot make trees"):
        build_engine(target, "draft", draft=draft, tree="dynamic", backend=backend)


def test_a_draft_beyond_its_context_drafts_nothing():
    drafter = cross_drafter(TableLM(6, seed=3))
    drafter.max_context = 6
    drafter.begin(PROMPT, SamplingParams(), None)
    assert drafter.propose(PROMPT, 2) is not None  # "abcab": 4 draft tokens + 2 fit
    assert drafter.propose(PROMPT + [2, 2], 2) is None  # "abcabcc": 5 + 2 do not


def test_server_request_uses_a_draft_model_with_another_vocabulary():
    import openai

    from server_helpers import WORDS, ServerThread, tiny_target, word_tokenizer
    from verispec.api import generate
    from verispec.models.loader import from_model
    from verispec.server import ServerConfig, create_app

    target = tiny_target()
    words = word_tokenizer(list(reversed(WORDS)) + ["zebra"])  # the same words under other ids, one more
    draft = from_model(tiny_llama(vocab=len(words), seed=3), words, name="tiny-words-reversed")
    chat = [{"role": "user", "content": "the cat sat on the mat and the dog"}]
    config = ServerConfig(method="ar", default_max_tokens=12, max_tokens=32)
    with ServerThread(create_app(target, config, draft=draft)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(model="tiny-words", messages=chat, max_tokens=12, temperature=0,
                                           extra_body={"verispec": {"method": "draft", "draft_length": 3}})
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny-words", messages=chat, max_tokens=4,
                                           extra_body={"verispec": {"method": "draft", "tree": "dynamic"}})
    assert r.choices[0].message.content == generate(target, chat=chat, max_new_tokens=12).text
    assert r.model_extra["verispec"]["method"] == "draft" and r.model_extra["verispec"]["drafted"] > 0
    assert "cannot make trees" in e.value.message and "\n" not in e.value.message
