"""Model loading: embedded defaults, local directories, GGUF files and hub ids -> LoadedModel."""

from verispec.models.loader import LoadedModel, load_model
from verispec.models.registry import EMBEDDED, cache_dir

__all__ = ["LoadedModel", "load_model", "EMBEDDED", "cache_dir"]
