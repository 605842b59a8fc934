"""The Python API: one call to generate with any method, on a loaded model or a model name."""

from __future__ import annotations

from typing import Iterator

from verispec.drafters import make_drafter
from verispec.engine import Engine, Generation, StepEvent
from verispec.errors import InvalidParameter
from verispec.options import check_speculation
from verispec.tree import parse_tree
from verispec.types import SamplingParams

TREE_OPTIONS = ("tree", "tree_budget", "tree_topk", "tree_depth", "verify_cost")
BACKEND_OPTIONS = ("backend", "exact", "compile", "weights")
SUFFIX_OPTIONS = ("suffix_cache", "suffix_alpha", "suffix_min_prob", "suffix_depth")
LOOKAHEAD_OPTIONS = ("lookahead_window", "lookahead_ngram", "lookahead_candidates")


def build_engine(target, method: str = "ar", draft=None, draft_length: int = 5, adaptive: bool = False,
                 ngram_max: int = 3, ngram_min: int = 1, max_draft_length: int = 16, *, tree=None,
                 tree_budget: int | str | None = None, tree_topk: int | None = None, tree_depth: int | None = None,
                 verify_cost: dict[int, float] | None = None, backend: str = "auto", exact: bool | None = None,
                 compile: bool = False, runner=None, head=None, suffix_cache="global", suffix_alpha: float = 1.0,
                 suffix_min_prob: float = 0.1, suffix_depth: int = 24, weights: str | None = None,
                 lookahead_window: int = 2, lookahead_ngram: int = 3, lookahead_candidates: int = 2) -> Engine:
    """An Engine for a LoadedModel (or a model name) and a method from verispec.drafters.METHODS.

    Trees (methods ngram and draft): tree = "dynamic", "static:<name>" (names in tree.STATIC_TREES),
    a list of paths such as [[0], [1], [0, 0]], or a tree.StaticTree / tree.DynamicTree; tree_budget
    (dynamic: nodes per step, or "auto" to choose it from the verification cost curve `verify_cost`
    {positions: seconds}, measured on the model when not given), tree_topk (dynamic: branching),
    tree_depth (maximum depth).

    Backend: "auto" (verispec.fast when the family has a fast module, else transformers), "hf", "fast".
    exact (fast path): True/False, None = on for greedy (bit-identical speculative and plain output);
    compile (fast path): torch.compile the decode/verify passes (slow first calls).
    weights (fast path): "auto", "bf16", "q8", "q4" (verispec/fast/quant.py); None = the loaded model's.
    runner: reuse the runner of an earlier engine built with the same backend/exact/compile (a fast
    runner holds a copy of the fused weights and a KV cache; servers keep a few and pass them in).
    head (methods eagle, medusa, dflash): a trained head folder (verispec train); None = the one shipped for the target.
    suffix_* (method suffix, verispec/drafters/suffix.py): suffix_cache "global" (the model's cross-request
    cache, shared by every engine in the process), "private" (this engine's own), "off", or a SuffixCache;
    suffix_alpha (at most alpha * match length tokens speculated), suffix_min_prob (smallest path score
    proposed), suffix_depth (deepest indexed substring).
    lookahead_* (method lookahead, verispec/drafters/lookahead.py): lookahead_window W (Jacobi window
    width), lookahead_ngram N (n-gram size), lookahead_candidates G (n-grams verified per step).
    """
    from verispec.models import load_model

    # the plain-valued options go through the schema the CLI and the server share (verispec.options)
    check_speculation(method=method, draft_length=draft_length, adaptive=adaptive, max_draft_length=max_draft_length,
                      ngram_max=ngram_max, ngram_min=ngram_min, tree_budget=tree_budget, tree_topk=tree_topk,
                      tree_depth=tree_depth, backend=backend, exact=exact,
                      suffix_cache=suffix_cache if isinstance(suffix_cache, str) else None, suffix_alpha=suffix_alpha,
                      suffix_min_prob=suffix_min_prob, suffix_depth=suffix_depth, lookahead_window=lookahead_window,
                      lookahead_ngram=lookahead_ngram, lookahead_candidates=lookahead_candidates,
                      tree=[list(p) if isinstance(p, tuple) else p for p in tree] if isinstance(tree, list) else
                      tree if isinstance(tree, str) else None)
    if isinstance(target, str):
        target = load_model(target)
    shape = parse_tree(tree, budget=tree_budget, topk=tree_topk, depth=tree_depth)
    drafter = make_drafter(method, target, draft=draft, ngram_max=ngram_max, ngram_min=ngram_min, backend=backend,
                           suffix_cache=suffix_cache, suffix_alpha=suffix_alpha, suffix_min_prob=suffix_min_prob,
                           suffix_depth=suffix_depth, lookahead_window=lookahead_window, lookahead_ngram=lookahead_ngram,
                           lookahead_candidates=lookahead_candidates, **({"head": head} if head is not None else {}))
    return Engine.for_model(target, drafter, draft_length=draft_length, adaptive=adaptive,
                            max_draft_length=max_draft_length, method=method, tree=shape, verify_cost=verify_cost,
                            backend=backend, runner_options={"exact": exact, "compile": compile, "weights": weights},
                            runner=runner)


def _params(temperature=0.0, top_k=0, top_p=1.0, seed=None, max_new_tokens=128, stop=()) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens, stop=tuple([stop] if isinstance(stop, str) else stop))


def stream(target, prompt: str | None = None, *, chat=None, method: str = "ar", draft=None, draft_length: int = 5,
           adaptive: bool = False, ngram_max: int = 3, ngram_min: int = 1, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = None, max_new_tokens: int = 128,
           stop=(), **tree_options) -> Iterator[StepEvent]:
    """Like generate(), but yields a StepEvent per verification step as tokens are accepted."""
    from verispec.models import load_model

    if isinstance(target, str):
        target = load_model(target)
    params = _params(temperature, top_k, top_p, seed, max_new_tokens, stop)
    unknown = set(tree_options) - set(TREE_OPTIONS) - set(BACKEND_OPTIONS) - set(SUFFIX_OPTIONS) - set(LOOKAHEAD_OPTIONS)
    if unknown:
        raise TypeError(f"stream() got unexpected keyword arguments {sorted(unknown)}")
    engine = build_engine(target, method, draft, draft_length, adaptive, ngram_max, ngram_min, **tree_options)
    ids = target.encode(prompt=prompt, chat=chat)
    yield from engine.stream(ids, params)


def generate(target, prompt: str | None = None, **kwargs) -> Generation:
    """Generate from `prompt` (raw text) or `chat=` (a user message or a list of messages).

    Methods: "ar" (plain decoding), "ngram" (prompt lookup), "draft" (draft model, draft=...; another
    vocabulary than the target's works too), "suffix", "lookahead", "eagle", "medusa".
    Sampling: temperature (0 = greedy), top_k, top_p, seed, max_new_tokens, stop.
    Trees: tree, tree_budget, tree_topk, tree_depth, verify_cost (see build_engine).
    """
    from verispec.models import load_model

    if isinstance(target, str):
        target = load_model(target)
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in ("method", "draft", "draft_length", "adaptive", "ngram_max", "ngram_min", "head") + TREE_OPTIONS + BACKEND_OPTIONS + SUFFIX_OPTIONS + LOOKAHEAD_OPTIONS}
    chat = kwargs.pop("chat", None)
    params = _params(**kwargs)
    engine = build_engine(target, **opts)
    return engine.generate(target.encode(prompt=prompt, chat=chat), params)


def generate_batch(target, prompts: list[str] | None = None, *, chats: list | None = None, max_batch: int = 8,
                   positions: int | str | None = None, **kwargs) -> list[Generation]:
    """Generate for many prompts (raw texts) or `chats` together: up to `max_batch` sequences share each
    target forward (verispec/batch.py), a new one joining as soon as one finishes; results in prompt
    order. positions: the verified positions a step spends across the batch (None: each sequence drafts
    as alone; "auto": chosen each step from the cost curve measured once on the first runner,
    batch.free_positions). Other options as in generate(); with a
    seed, prompt i samples with seed + i. Greedy outputs are each prompt's generate() output (exact mode:
    bit for bit)."""
    from verispec.batch import Batch, continuous
    from verispec.models import load_model

    if isinstance(target, str):
        target = load_model(target)
    if (prompts is None) == (chats is None):
        raise InvalidParameter("give prompts= or chats=, one of them")
    opts = {k: kwargs.pop(k) for k in list(kwargs) if k in ("method", "draft", "draft_length", "adaptive", "ngram_max", "ngram_min", "head") + TREE_OPTIONS + BACKEND_OPTIONS + SUFFIX_OPTIONS + LOOKAHEAD_OPTIONS}
    seed = kwargs.pop("seed", None)
    ids = [target.encode(prompt=p) for p in prompts] if prompts is not None else [target.encode(chat=c) for c in chats]
    params = [_params(seed=None if seed is None else seed + i, **kwargs) for i in range(len(ids))]
    free = [build_engine(target, **opts) for _ in range(min(max_batch, len(ids)))]  # an engine per place, reused
    cost = None
    if positions == "auto":
        from verispec.tree import measure_verify_cost

        positions, cost = None, measure_verify_cost(free[0].runner) if free else None
    batch = Batch(max_batch=max_batch, positions=positions, cost=cost)
    runs = dict(continuous(batch, free, [(i, ids[i], params[i]) for i in range(len(ids))]))
    return [runs[i].result() for i in range(len(ids))]
