"""verispec: lossless speculative decoding for Hugging Face causal language models.

The public API in one place:

    from verispec import load_model, generate, SamplingParams
    target = load_model("smollm2-135m", dtype="bfloat16")
    out = generate(target, "Summarise: ...", method="ngram", draft_length=6)
    print(out.text, out.stats.mean_accepted_length)
    outs = generate_batch(target, chats=["Hi", "Name a fruit"], method="ngram")   # many prompts, shared forwards
"""

from verispec.errors import VerispecError
from verispec.types import SamplingParams

__all__ = ["VerispecError", "SamplingParams", "load_model", "generate", "stream", "generate_batch", "Engine"]
__version__ = "0.1.0"


def __getattr__(name):  # lazy: importing verispec must not import torch/transformers eagerly
    if name == "load_model":
        from verispec.models import load_model

        return load_model
    if name in ("generate", "stream", "generate_batch", "Engine"):
        from verispec import api

        return getattr(api, name)
    raise AttributeError(name)
