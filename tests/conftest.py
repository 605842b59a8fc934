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


@pytest.fixture
def one_thread(request):
    """Tiny models and tables: one intra-op thread (a 2-thread barrier costs far more than these ops,
    and ruinously so on a busy machine); real models keep the session's setting. A test file opts in
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    if request.node.get_closest_marker("real_model"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded SmolLM2-135M in float32 (converted once into the cache)."""
    from verispec.models import load_model

    return load_model("smollm2-135m", dtype="float32")
