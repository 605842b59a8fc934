"""Shared test fixtures: tiny random transformers models (built in the test, no download) and helpers.

Tiny models come with a trivial "tokenizer" (token ids printed as numbers), enough for the engine.
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


class NumberTokenizer:
    """Stands in for a tokenizer for tiny models: ids <-> space-separated numbers."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.chat_template = None

    def get_vocab(self) -> dict[str, int]:
        return {str(i): i for i in range(self.vocab_size)}

    def __call__(self, text: str, add_special_tokens: bool = True):
        return {"input_ids": [int(t) % self.vocab_size for t in text.split()]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(i)}" for i in ids)


def tiny_llama(vocab: int = 32, seed: int = 0, layers: int = 2, hidden: int = 32, dtype=torch.float32, eos: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      eos_token_id=eos, bos_token_id=0, pad_token_id=0,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():  # sharpen the random logits a little so greedy paths are not all near-ties
        model.lm_head.weight.mul_(8.0)
    return model


def tiny_gemma3(vocab: int = 32, seed: int = 0, layers: int = 3, hidden: int = 32, sliding_window: int = 8, dtype=torch.float32):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                           sliding_window=sliding_window, layer_types=["sliding_attention", "sliding_attention", "full_attention"][:layers],
                           eos_token_id=None, bos_token_id=0, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0) if not cfg.tie_word_embeddings else model.model.embed_tokens.weight.mul_(4.0)
    return model


def loaded(model, name: str = "tiny", eos: int | None = None):
    """A verispec LoadedModel around a tiny model."""
    from verispec.models.loader import from_model

    vocab = model.config.vocab_size
    return from_model(model, NumberTokenizer(vocab, eos), name=name)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test file, its module fixtures included: tiny models and tables are all
    per-op overhead, and on a shared 2-core machine a 2-thread OpenMP barrier stalls whenever the other
    core is busy. A test file opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2-135M in float32 (converted once into the cache)."""
    from verispec.models import load_model

    return load_model("smollm2-135m", dtype="float32")


def fast_greedy_equals_plain(target, prompts, max_new_tokens: int, method: str, check=None, **options) -> int:
    """The real-model exactness check: for each prompt, `method` on the fast path (exact mode, and
    check(engine) where given) gives plain decoding's greedy tokens; returns the tokens accepted from
    drafts over all prompts."""
    from verispec.api import build_engine
    from verispec.types import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens)
    accepted = 0
    for text in prompts:
        ids = target.encode(prompt=text)
        plain = build_engine(target, "ar", backend="fast").generate(ids, params)
        engine = build_engine(target, method, backend="fast", **options)
        assert engine.runner.mode.exact and (check is None or check(engine))
        got = engine.generate(ids, params)
        assert got.token_ids == plain.token_ids, text
        accepted += got.stats.accepted
    return accepted


def three_token_distribution():
    """A tiny target with several likely tokens at each step, and the exact distribution of its first
    3 sampled tokens after [1, 2, 3] at temperature 1, top_p 0.95, enumerated: (target, {(a, b, c): p})."""
    from verispec.sampling import logits_to_probs
    from verispec.types import SamplingParams

    model = tiny_llama(vocab=8, seed=0, layers=1, hidden=16)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.15)  # several likely tokens at each step
    params = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=3)
    prompt = torch.tensor([1, 2, 3])
    with torch.inference_mode():
        p1 = logits_to_probs(model(prompt[None]).logits[0, -1], params)
        seq1 = torch.cat([prompt.repeat(8, 1), torch.arange(8)[:, None]], 1)
        p2 = logits_to_probs(model(seq1).logits[:, -1], params)
        seq2 = torch.cat([seq1.repeat_interleave(8, 0), torch.arange(8).repeat(8)[:, None]], 1)
        p3 = logits_to_probs(model(seq2).logits[:, -1], params).reshape(8, 8, 8)
    exact = {(a, b, c): float(p1[a] * p2[a, b] * p3[a, b, c]) for a in range(8) for b in range(8) for c in range(8)
             if float(p1[a] * p2[a, b] * p3[a, b, c]) > 0}
    return loaded(model), exact


def distilled_features(target, folder):
    """Self-distilled records (the target's greedy answers to 12 random prompts) and their features in
    `folder`: (records, shard paths, feature layers)."""
    from verispec.drafters.eagle import default_feature_layers
    from verispec.engine import Engine
    from verispec.train.extract import extract_features
    from verispec.types import SamplingParams

    g = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    plain = Engine.for_model(target, None, backend="hf")
    records = []
    for i in range(12):
        prompt = torch.randint(1, vocab, (int(torch.randint(3, 12, (1,), generator=g)),), generator=g).tolist()
        ans = plain.generate(prompt, SamplingParams(max_new_tokens=40)).token_ids
        records.append({"id": str(i), "source": "test", "prompt_ids": prompt, "answer_ids": ans})
    L = target.model.config.num_hidden_layers
    layers = sorted(set(default_feature_layers(L)) | {L})
    paths = extract_features(target, records, folder, layers, shard_size=5, progress=False)
    return records, paths, layers


def skip_without_8bit() -> None:
    """Skip where no 8-bit kernel runs for bfloat16 on this CPU (the heads' copies for a quantized target)."""
    from verispec.fast import quant

    why = quant.available("q8", torch.bfloat16, torch.device("cpu"))
    if why is not None:
        pytest.skip(f"no 8-bit kernel here: {why}")


def skip_without_native(copies: str) -> None:
    """Skip where the native extension is not built, or 8-bit copies are asked for and no 8-bit kernel runs."""
    from verispec.fast import native

    if native.module() is None:
        pytest.skip(native.status())
    if copies == "8-bit":
        skip_without_8bit()


def feature_drafter(cls, module, vocab_size: int, ctx: list[int], feats, copies: str, python: bool):
    """A trained-head drafter (EagleDrafter, DFlashDrafter) over a copy of `module`, with weight copies as
    `copies` says ("none", "bf16", "8-bit"), its native step turned off where `python` (else checked to
    run), begun on ctx and fed the target features of ctx[:-1]."""
    import copy

    from verispec.types import SamplingParams

    d = cls(copy.deepcopy(module).eval(), vocab_size, weights_dtype=None if copies == "none" else torch.bfloat16,
            quantized=copies == "8-bit", native=not python)
    if python:
        assert d._native_args() is None
    else:
        assert d._native_args() is not None
    d.begin(ctx, SamplingParams(), None)
    d.observe_features(feats)
    return d
