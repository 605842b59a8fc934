"""The Python API: one call to generate with any method, on a loaded model or a model name.

Every entry point takes the same speculation options: a `settings=` object (verispec.options.
SpeculationSettings) and/or its options by flat name as keywords (method=, draft_length=, tree=,
suffix_alpha=, head=, ...), which override the object's. generate, stream and generate_batch also take
the sampling options (SAMPLING_OPTIONS); any other keyword is an InvalidParameter naming the valid ones.
"""

from __future__ import annotations

from typing import Any, Iterator

from verispec.drafters import make_drafter
from verispec.engine import Engine, Generation, StepEvent
from verispec.errors import InvalidParameter
from verispec.options import SpeculationSettings
from verispec.tree import parse_tree
from verispec.types import SamplingParams

SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "stop")


def settings_of(settings: SpeculationSettings | None = None, **options: Any) -> SpeculationSettings:
    """`settings` (None: the defaults) with the options given by flat name overriding it."""
    if settings is not None and not isinstance(settings, SpeculationSettings):
        raise InvalidParameter(f"settings must be a SpeculationSettings, got {type(settings).__name__}")
    if settings is None:
        return SpeculationSettings.of(**options)
    return settings.replace(**options) if options else settings


def build_engine(target, method: str | None = None, *, settings: SpeculationSettings | None = None, runner=None,
                 **options: Any) -> Engine:
    """An Engine for a LoadedModel (or a model name) speculating as `settings` say, with `method` and the
    keyword `options` (flat names of SpeculationSettings) overriding them.

    Options (types, ranges and defaults: verispec.options; CLI flags and request keys have the same names):
    method (verispec.drafters.METHODS), draft_length, adaptive, max_draft_length; ngram_max, ngram_min;
    suffix_cache ("global": the model's cross-request cache shared by every engine in the process,
    "private", "off", or a SuffixCache), suffix_alpha, suffix_min_prob, suffix_depth; lookahead_window,
    lookahead_ngram, lookahead_candidates; tree ("dynamic", "static:<name>", a list of paths such as
    [[0], [1], [0, 0]], or a tree.StaticTree / tree.DynamicTree), tree_budget (dynamic: nodes per step, or
    "auto" to choose it from the verification cost curve `verify_cost` {positions: seconds}, measured on
    the model when not given), tree_topk, tree_depth; backend ("auto": verispec.fast when the family has a
    fast module, else transformers; "hf", "fast"), exact (fast path; None = on for greedy), compile,
    weights ("auto", "bf16", "q8", "q4"; None = the loaded model's); draft (a LoadedModel or a model name,
    method draft), head (a trained head folder for eagle, medusa, dflash; None = the shipped one).

    runner: reuse the runner of an earlier engine built with the same backend/exact/compile (a fast
    runner holds a copy of the fused weights and a KV cache; servers keep a few and pass them in).
    """
    from verispec.models import load_model

    settings = settings_of(settings, **({"method": method} if method is not None else {}), **options)
    if isinstance(target, str):
        target = load_model(target)
    tree = settings.tree
    shape = parse_tree(tree.shape, budget=tree.budget, topk=tree.topk, depth=tree.depth)
    drafter = make_drafter(settings.method, target, settings)
    return Engine.for_model(target, drafter, draft_length=settings.draft_length, adaptive=settings.adaptive,
                            max_draft_length=settings.max_draft_length, method=settings.method, tree=shape,
                            verify_cost=tree.verify_cost, backend=settings.backend.name,
                            runner_options=settings.backend.runner_options(), runner=runner)


def _split(kwargs: dict) -> tuple[dict, dict]:
    """(sampling options, speculation options) of an entry point's keywords; anything else is refused with
    the same message in generate, stream and generate_batch."""
    spec = SpeculationSettings.options()
    unknown = [k for k in kwargs if k not in SAMPLING_OPTIONS and k not in spec]
    if unknown:
        raise InvalidParameter(f"unknown option '{unknown[0]}'; use one of: "
                               f"{', '.join(SAMPLING_OPTIONS + tuple(spec))}, settings")
    sampling = {k: v for k, v in kwargs.items() if k in SAMPLING_OPTIONS}
    return sampling, {k: v for k, v in kwargs.items() if k in spec}


def _params(temperature=0.0, top_k=0, top_p=1.0, seed=None, max_new_tokens=128, stop=()) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                          max_new_tokens=max_new_tokens, stop=tuple([stop] if isinstance(stop, str) else stop))


def stream(target, prompt: str | None = None, *, chat=None, settings: SpeculationSettings | None = None,
           **kwargs: Any) -> Iterator[StepEvent]:
    """Like generate(), but yields a StepEvent per verification step as tokens are accepted. The options,
    the model and the prompt are checked as it is called, before the first step is asked for."""
    from verispec.models import load_model

    sampling, options = _split(kwargs)
    settings = settings_of(settings, **options)
    if isinstance(target, str):
        target = load_model(target)
    params = _params(**sampling)
    engine = build_engine(target, settings=settings)
    return engine.stream(target.encode(prompt=prompt, chat=chat), params)


def generate(target, prompt: str | None = None, *, chat=None, settings: SpeculationSettings | None = None,
             **kwargs: Any) -> Generation:
    """Generate from `prompt` (raw text) or `chat=` (a user message or a list of messages).

    Methods: "ar" (plain decoding), "ngram" (prompt lookup), "draft" (draft model, draft=...; another
    vocabulary than the target's works too), "suffix", "lookahead", "eagle", "medusa", "dflash", ...
    Sampling: temperature (0 = greedy), top_k, top_p, seed, max_new_tokens, stop.
    Speculation: settings= and/or any option of build_engine by name (trees, backend, suffix_*, ...).
    """
    from verispec.models import load_model

    sampling, options = _split(kwargs)
    settings = settings_of(settings, **options)
    if isinstance(target, str):
        target = load_model(target)
    params = _params(**sampling)
    engine = build_engine(target, settings=settings)
    return engine.generate(target.encode(prompt=prompt, chat=chat), params)


def generate_batch(target, prompts: list[str] | None = None, *, chats: list | None = None, max_batch: int = 8,
                   positions: int | str | None = None, settings: SpeculationSettings | None = None,
                   **kwargs: Any) -> list[Generation]:
    """Generate for many prompts (raw texts) or `chats` together: up to `max_batch` sequences share each
    target forward (verispec/batch.py), a new one joining as soon as one finishes; results in prompt
    order. positions: the verified positions a step spends across the batch (None: each sequence drafts
    as alone; "auto": chosen each step from the cost curve measured once on the first runner,
    batch.free_positions). Other options as in generate(); with a
    seed, prompt i samples with seed + i. Greedy outputs are each prompt's generate() output (exact mode:
    bit for bit)."""
    from verispec.batch import Batch, continuous
    from verispec.models import load_model

    sampling, options = _split(kwargs)
    settings = settings_of(settings, **options)
    if isinstance(target, str):
        target = load_model(target)
    if (prompts is None) == (chats is None):
        raise InvalidParameter("give prompts= or chats=, one of them")
    seed = sampling.pop("seed", None)
    ids = [target.encode(prompt=p) for p in prompts] if prompts is not None else [target.encode(chat=c) for c in chats]
    params = [_params(seed=None if seed is None else seed + i, **sampling) for i in range(len(ids))]
    free = [build_engine(target, settings=settings) for _ in range(min(max_batch, len(ids)))]  # an engine per place, reused
    cost = None
    if positions == "auto":
        from verispec.tree import measure_verify_cost

        positions, cost = None, measure_verify_cost(free[0].runner) if free else None
    batch = Batch(max_batch=max_batch, positions=positions, cost=cost)
    runs = dict(continuous(batch, free, [(i, ids[i], params[i]) for i in range(len(ids))]))
    return [runs[i].result() for i in range(len(ids))]
