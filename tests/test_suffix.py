"""Suffix decoding (verispec/drafters/suffix.py): the trie's counts and the speculation trees equal a
brute-force reading of the stored sequences; the cross-request cache stays within its bound (also under
threads); greedy output equals plain decoding token for token (chains and trees, float32 and bfloat16
exact mode on the fast path, transformers backend); sampled output has the target's exact
distribution (chain and tree, with the cache filled by the earlier samples); bad options are refused;
the server shares one cache across requests.
"""

from __future__ import annotations

import itertools
import math
import random
import threading

import pytest
import torch

from conftest import loaded, tiny_llama
from verispec.api import build_engine
from verispec.drafters.suffix import (SuffixCache, SuffixDrafter, SuffixTrie, best_tree, global_cache,
                                      make_suffix_drafter)
from verispec.errors import InvalidParameter
from verispec.tree import StaticTree
from verispec.types import SamplingParams


pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------------------
# brute force: everything read directly off the sequences


def occurrences(seqs, w) -> int:
    w, n = list(w), len(w)
    return sum(1 for s in seqs for i in range(len(s) - n + 1) if s[i:i + n] == w)


def brute_counts(seqs, pattern, depth) -> dict[int, int]:
    if len(pattern) + 1 > depth:
        return {}
    out = {}
    for tok in sorted({t for s in seqs for t in s}):
        c = occurrences(seqs, list(pattern) + [tok])
        if c:
            out[tok] = c
    return out


def brute_tree(seqs, pattern, depth, budget, topk=None, max_depth=None, min_prob=0.1, allowed=None):
    """All nodes below `pattern` with their path score, best `budget` by (-D, token path)."""
    nodes = []

    def rec(path, score, ranks):
        if max_depth is not None and len(path) >= max_depth:
            return
        counts = brute_counts(seqs, list(pattern) + list(path), depth)
        total = sum(counts.values())
        for rank, (tok, c) in enumerate(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))):
            if topk is not None and rank >= topk:
                break
            d = score * c / total
            if d < min_prob:
                break
            r = ranks + (rank,)
            if allowed is not None and r not in allowed:
                continue
            nodes.append((d, path + (tok,)))
            rec(path + (tok,), d, r)

    rec((), 1.0, ())
    chosen = sorted(nodes, key=lambda n: (-n[0], n[1]))[:budget]
    index = {n[1]: i for i, n in enumerate(chosen)}
    return ([n[1][-1] for n in chosen], [index[n[1][:-1]] if len(n[1]) > 1 else -1 for n in chosen],
            [n[0] for n in chosen])


def brute_best(seqs, context, depth, budget, alpha, max_pattern=None, **kw):
    """(score, pattern length, tokens, parents) of the best tree over all matching pattern lengths."""
    best = None
    for p in range(1, min(len(context), depth - 1, max_pattern or depth) + 1):
        pattern = context[len(context) - p:]
        if occurrences(seqs, pattern) == 0:
            break
        cap = min(budget, math.floor(alpha * p + 1e-9))
        if cap < 1:
            continue
        tokens, parents, scores = brute_tree(seqs, pattern, depth, cap, **kw)
        if tokens and (best is None or sum(scores) >= best[0]):
            best = (sum(scores), p, tokens, parents)
    return best


def random_seqs(rng, n, vocab, lo=5, hi=40):
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def distinct_substrings(seqs, depth) -> int:
    return len({tuple(s[i:i + n]) for s in seqs for n in range(1, depth + 1) for i in range(len(s) - n + 1)})


# ----------------------------------------------------------------------------------------------------
# the structure


@pytest.mark.parametrize("seed", range(4))
def test_trie_counts_match_brute_force_through_extends_and_removals(seed):
    rng = random.Random(seed)
    vocab, depth = 3, rng.choice([3, 5])
    trie = SuffixTrie(depth)
    seqs = random_seqs(rng, 6, vocab)
    for i, s in enumerate(seqs):  # in random chunks: the open suffixes carry over between extends
        trie.open(i)
        pos = 0
        while pos < len(s):
            step = rng.randint(1, 7)
            trie.extend(i, s[pos:pos + step])
            pos += step
    for removed in (None, 2, 0, 5):
        if removed is not None:
            trie.remove(removed)
        live = [s for i, s in enumerate(seqs) if i in trie.sequences]
        assert len(trie) == distinct_substrings(live, depth)  # no node leaks, none missing
        for n in range(depth):
            for pattern in itertools.product(range(vocab), repeat=n):
                assert trie.continuation_counts(pattern) == brute_counts(live, pattern, depth), (removed, pattern)


@pytest.mark.parametrize("seed", range(6))
def test_speculation_trees_match_brute_force(seed):
    rng = random.Random(100 + seed)
    vocab, depth = rng.choice([2, 3, 4]), rng.choice([4, 6, 8])
    seqs = random_seqs(rng, 4, vocab, 10, 60)
    trie = SuffixTrie(depth)
    for i, s in enumerate(seqs):
        trie.open(i)
        trie.extend(i, s)
    static = StaticTree.named("small")
    settings = [dict(budget=6, alpha=1.0, min_prob=0.1), dict(budget=12, alpha=4.0, min_prob=0.0, topk=2),
                dict(budget=3, alpha=0.5, min_prob=0.3, max_depth=2),
                dict(budget=len(static.paths), alpha=2.0, min_prob=0.05, max_depth=static.depth,
                     allowed=set(static.paths))]
    for _ in range(25):
        s = rng.choice(seqs)
        context = s[: rng.randint(1, len(s))] if rng.random() < 0.7 else random_seqs(rng, 1, vocab, 1, 8)[0]
        for kw in settings:
            kw = dict(kw)
            budget, alpha = kw.pop("budget"), kw.pop("alpha")
            got = best_tree(trie, context, budget, alpha=alpha, **kw)
            want = brute_best(seqs, context, depth, budget, alpha, **kw)
            if want is None:
                assert got is None
            else:
                assert (got.tokens, got.parents, got.pattern_length) == (want[2], want[3], want[1]), (context, kw)
                assert got.score == pytest.approx(want[0])
                assert len(got) <= math.floor(alpha * got.pattern_length + 1e-9)  # the paper's MAX_SPEC


def test_drafter_takes_the_better_of_request_and_cache():
    """Chain and tree proposals equal the brute-force best over this request's tokens and the cache's
    earlier outputs (ties: the longer pattern, then the request)."""
    rng = random.Random(7)
    depth = 6
    for trial in range(20):
        cache = SuffixCache(depth=depth)
        outputs = random_seqs(rng, 3, 3, 10, 30)
        for out in outputs:
            cache.extend(cache.open(), out)
        drafter = SuffixDrafter(cache, alpha=2.0, min_prob=0.1, depth=depth)
        prompt = random_seqs(rng, 1, 3, 4, 20)[0]
        drafter.begin(prompt, SamplingParams(), None)
        context = prompt + random_seqs(rng, 1, 3, 0, 6)[0]
        for k, topk in ((4, 1), (8, 3)):
            mine = brute_best([context], context, depth, k, 2.0, topk=topk, max_depth=k)
            theirs = brute_best(outputs, context, depth, k, 2.0, max_pattern=depth - 1, topk=topk, max_depth=k)
            cands = [c for c in (mine, theirs) if c is not None]
            want = None
            if cands:
                want = mine if theirs is None or (mine is not None and (mine[0], mine[1]) >= (theirs[0], theirs[1])) else theirs
            if topk == 1:
                got = drafter.propose(context, k)
                assert (got.tokens.tolist() if got else None) == (want[2] if want else None), trial
            else:
                from verispec.tree import DynamicTree

                got = drafter.propose_tree(context, DynamicTree(budget=k, topk=topk, depth=k))
                if want is None:
                    assert got is None, trial
                else:
                    assert (got.tokens.tolist(), got.parents) == (want[2], want[3]), trial


# ----------------------------------------------------------------------------------------------------
# the cross-request cache


def test_cache_bound_holds_and_evicts_oldest_first():
    rng = random.Random(3)
    cache = SuffixCache(max_nodes=300, depth=5)
    live: dict[int, list[int]] = {}
    for _ in range(40):
        seq, toks = cache.open(), []
        live[seq] = toks
        for _ in range(rng.randint(1, 4)):
            chunk = [rng.randrange(4) for _ in range(rng.randint(1, 15))]
            cache.extend(seq, chunk)
            if seq in cache.trie.sequences:
                toks.extend(chunk)
            assert len(cache) <= 300
        kept = cache.trie.sequences
        assert kept == sorted(kept) and kept == sorted(live)[len(live) - len(kept):]  # the newest survive
        kept_seqs = [live[i] for i in kept]
        assert len(cache) == distinct_substrings(kept_seqs, 5)
    assert cache.evicted > 0
    for pattern in itertools.product(range(4), repeat=2):
        assert cache.trie.continuation_counts(pattern) == brute_counts(kept_seqs, pattern, 5)


def test_cache_is_consistent_under_threads():
    cache = SuffixCache(max_nodes=2000, depth=6)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        try:
            for _ in range(30):
                seq = cache.open()
                for _ in range(3):
                    cache.extend(seq, [rng.randrange(5) for _ in range(10)])
                    cache.best_tree([rng.randrange(5) for _ in range(4)], 8, alpha=2.0)
                    assert len(cache) <= 2000
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    kept = [cache.trie.tokens(i) for i in cache.trie.sequences]
    assert len(cache) == distinct_substrings(kept, 6)


def test_global_cache_is_one_per_model_and_engines_share_it():
    target = loaded(tiny_llama(), name="tiny-suffix-global")
    a = build_engine(target, "suffix", backend="hf")
    b = build_engine(target, "suffix", backend="hf")
    assert a.drafter.cache is b.drafter.cache is global_cache("tiny-suffix-global")
    assert build_engine(target, "suffix", suffix_cache="private", backend="hf").drafter.cache is not a.drafter.cache
    alone = build_engine(target, "suffix", suffix_cache="off", backend="hf")
    assert alone.drafter.cache is None
    prompt, params = [1, 2, 3, 4, 5, 6, 7], SamplingParams(max_new_tokens=30)
    first = a.generate(prompt, params)
    again = b.generate(prompt, params)  # another engine, the same request: drafted from the first one's output
    assert global_cache("tiny-suffix-global").sequences == 2
    assert again.token_ids == first.token_ids
    assert again.stats.accepted > alone.generate(prompt, params).stats.accepted


# ----------------------------------------------------------------------------------------------------
# lossless: greedy


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3], [5, 9, 9, 2, 7, 5, 9], [3] * 12, [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3],
           [30, 1, 22, 5, 9, 9]]


@pytest.mark.parametrize("backend,dtype", [("fast", torch.float32), ("fast", torch.bfloat16), ("hf", torch.float32)])
def test_greedy_output_equals_plain_decoding(backend, dtype):
    """Chains and trees, with a cache filled by the earlier prompts (a repeated prompt is drafted from
    it); the fast path (exact mode in bfloat16) must give the same tokens, bit for bit."""
    from test_exactness import assert_same_or_tie

    target = loaded(tiny_llama(dtype=dtype), name=f"tiny-suffix-{backend}-{dtype}")
    params = SamplingParams(max_new_tokens=40)
    configs = [dict(draft_length=1), dict(draft_length=8, suffix_alpha=2.0),
               dict(tree="dynamic", tree_budget=8), dict(tree="static:medium", suffix_min_prob=0.0)]
    caches = [SuffixCache() for _ in configs]
    for prompt in PROMPTS:
        plain = build_engine(target, "ar", backend=backend).generate(prompt, params).token_ids
        for cfg, cache in zip(configs, caches):
            g = build_engine(target, "suffix", backend=backend, suffix_cache=cache, **cfg).generate(prompt, params)
            if backend == "fast":
                assert g.token_ids == plain, (prompt, cfg)
            else:
                assert_same_or_tie(target.model, prompt, plain, g.token_ids, f"suffix {cfg}")
    assert g.stats.accepted > 0


# ----------------------------------------------------------------------------------------------------
# lossless: sampling


def test_sampled_chain_matches_the_target_distribution():
    """The point-mass chain of test_distribution.py's cases, drafted from a cache that every earlier
    sample filled (so the drafts change from sample to sample)."""
    from test_distribution import N, PROMPT, check, draw
    from table_lm import TableLM
    from verispec.engine import Engine

    target = TableLM(6, seed=0)
    drafter = make_suffix_drafter("table", cache=SuffixCache(), alpha=2.0, min_prob=0.0)
    engine = Engine(target, set(), lambda ids: "", 1000, drafter=drafter, draft_length=3)
    kw = dict(temperature=0.9, top_k=5)
    samples = draw(engine, N, **kw)
    check(samples, target.exact_distribution(PROMPT, SamplingParams(**kw)))
    assert drafter.cache.sequences == N and engine.last.stats.drafted > 0


def test_sampled_tree_matches_the_target_distribution():
    from test_tree_distribution import PROMPT, Table, TableRunner, check
    from verispec.engine import Engine
    from verispec.tree import parse_tree

    target = Table(5)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    drafter = make_suffix_drafter("table", cache=SuffixCache(), alpha=3.0, min_prob=0.0)
    engine = Engine(TableRunner(target), set(), lambda ids: "", 1000, drafter=drafter, tree=parse_tree("static:small"))
    samples, branched = [], 0
    for i in range(4000):
        g = engine.generate(PROMPT, SamplingParams(max_new_tokens=3, seed=i, temperature=params.temperature,
                                                   top_p=params.top_p))
        samples.append(tuple(g.token_ids))
        branched += len(g.stats.offered_by_rank) > 1  # a node offered a second-ranked sibling
    check(samples, target.exact(PROMPT, params))
    assert branched > 100  # branching trees were verified, not only chains


# ----------------------------------------------------------------------------------------------------
# options


@pytest.mark.parametrize("opts,word", [
    (dict(suffix_alpha=0), "suffix_alpha"), (dict(suffix_alpha=-1.0), "suffix_alpha"),
    (dict(suffix_alpha="2"), "suffix_alpha"), (dict(suffix_min_prob=1.5), "suffix_min_prob"),
    (dict(suffix_depth=1), "suffix_depth"), (dict(suffix_depth=65), "suffix_depth"),
    (dict(suffix_depth=2.5), "suffix_depth"), (dict(suffix_cache="shared"), "suffix_cache"),
])
def test_bad_options_are_refused_in_one_line(opts, word):
    target = loaded(tiny_llama(), name="tiny-suffix-options")
    with pytest.raises(InvalidParameter) as e:
        build_engine(target, "suffix", backend="hf", **opts)
    assert word in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(InvalidParameter):
        SuffixCache(max_nodes=0)
    with pytest.raises(InvalidParameter):
        SuffixDrafter(alpha=float("nan"))


def test_cli_refuses_a_bad_option_before_loading_a_model():
    from typer.testing import CliRunner

    from verispec.cli import app

    r = CliRunner().invoke(app, ["generate", "x", "--method", "suffix", "--suffix-min-prob", "2", "--model", "/nonexistent"])
    assert r.exit_code != 0
    out = r.output.strip()
    assert "--suffix-min-prob" in out and len(out.splitlines()) == 1  # the CLI names the flag (shared schema, label=)


# ----------------------------------------------------------------------------------------------------
# the server: one cache across requests


def test_server_requests_share_one_cache():
    import openai

    from server_helpers import ServerThread, tiny_target
    from verispec.server import ServerConfig, create_app

    target = tiny_target(seed=2)
    cache = global_cache(target.name)
    cache.clear()
    config = ServerConfig(method="suffix", draft_length=6, default_max_tokens=24, max_tokens=64, max_prompt_tokens=40)
    with ServerThread(create_app(target, config)) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        chat = [{"role": "user", "content": "the cat sat on the mat and the dog ran"}]
        first = client.chat.completions.create(model=target.name, messages=chat, max_tokens=24, temperature=0)
        assert cache.sequences == 1
        again = client.chat.completions.create(model=target.name, messages=chat, max_tokens=24, temperature=0,
                                               extra_body={"verispec": {"suffix_alpha": 2.0}})
        assert cache.sequences == 2
        assert again.choices[0].message.content == first.choices[0].message.content
        assert again.model_extra["verispec"]["accepted"] > first.model_extra["verispec"]["accepted"]
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=target.name, messages=chat, max_tokens=4,
                                           extra_body={"verispec": {"suffix_depth": 0}})
        assert "suffix_depth" in e.value.message


# ----------------------------------------------------------------------------------------------------
# the real model


@pytest.mark.real_model
def test_smollm2_bfloat16_exact_mode_equals_plain_decoding():
    """SmolLM2-135M in bfloat16 on the fast path (exact mode): chain and dynamic tree equal plain
    decoding; a repeated request is drafted from the first one's output (a similar request may or may
    not share text with it: that depends on the model's greedy wording, which an ulp can change)."""
    from verispec.models import load_model

    torch.set_num_threads(2)
    target = load_model("smollm2-135m", dtype="bfloat16")
    params = SamplingParams(max_new_tokens=32)
    chats = ["Translate to French: the red house is big.", "Translate to French: the blue car is small.",
             "Translate to French: the red house is big."]
    for opts in (dict(draft_length=8), dict(tree="dynamic", tree_budget=15)):
        cache = SuffixCache()
        for chat in chats:
            ids = target.encode(chat=chat)
            plain = build_engine(target, "ar").generate(ids, params)
            g = build_engine(target, "suffix", suffix_cache=cache, **opts).generate(ids, params)
            assert g.token_ids == plain.token_ids, (chat, opts)
        assert cache.sequences == 3 and g.stats.accepted > 0


def test_bench_keeps_the_cache_across_questions_but_not_the_warm_up():
    """Each suffix contender of a bench keeps a cache of its own across the questions, in question order,
    without the warm-up's answer; two of them in one run never read each other's answers to the same
    question, and the model's global cache (the server's) is left alone."""
    from verispec.bench.baselines import VerispecContender, parse_method
    from verispec.bench.harness import run_bench
    from verispec.bench.prompts import Question, load_prompts

    assert {q.category for q in load_prompts("shared_tasks")} == {"gsm8k_json", "gsm8k_steps", "code_docstring", "code_tests"}
    target = loaded(tiny_llama(), name="tiny-suffix-bench")
    questions = [Question(str(i), "t", [" ".join(str(t) for t in p)]) for i, p in enumerate(PROMPTS[:3])]
    suffixes = [VerispecContender(target, parse_method(m)) for m in ("suffix", "suffix:suffix_alpha=2.0")]
    result = run_bench(target, ["ar", *suffixes], questions, max_new_tokens=12, warmup=1, progress=False)
    assert not result["mismatches"]
    assert len(global_cache("tiny-suffix-bench")) == 0
    assert suffixes[0].engine.drafter.cache is not suffixes[1].engine.drafter.cache
    for c in suffixes:  # its cache holds its 3 measured answers, in order; the warm-up's answer was forgotten
        cache = c.engine.drafter.cache
        answers = [r["turns"][0]["token_ids"] for r in result["runs"] if r["method"] == c.label]
        stored = [cache.trie.tokens(i) for i in cache.trie.sequences]
        assert len(stored) == 3 and all(s[:len(a)] == a for s, a in zip(stored, answers))