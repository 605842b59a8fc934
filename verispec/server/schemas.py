"""Request bodies of the HTTP API (pydantic), shaped like OpenAI's so existing clients work unchanged.

Ranges that do not depend on the server's configuration are checked here (temperature in [0, 2] as
OpenAI documents it, top_p in (0, 1], n >= 1); limits that do (max_tokens, prompt length) are checked
in the app. Unknown top-level fields are ignored, as OpenAI-compatible servers usually do, except
those that would silently change the output (logprobs, penalties, tools, ...): those are refused.
Speculation settings travel in the extension object "verispec" (openai client: extra_body=), whose
fields, types and ranges are verispec.options.SpeculationChoices: SpeculationSettings' options by flat
name (suffix_alpha, tree_budget, ...), the object the CLI and the Python API build too.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from verispec.options import SpeculationChoices


class SpeculationOptions(SpeculationChoices):
    """The "verispec" extension object of a request: the shared speculation options, plus a timeout
    that can only shorten the server's per-request timeout.

    Other fields are kept (extra="allow") only so that the app can answer them precisely: a server
    setting (draft, head, compile, ...) or an unknown option, each a 400 naming the field.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    timeout: float | None = Field(None, gt=0, description="seconds; can only shorten the server's limit")

    def engine_options(self) -> dict[str, Any]:
        """The options the request set, by flat name (the unknown and reserved ones too: the app refuses them)."""
        opts = {k: v for k, v in self.model_dump(exclude={"timeout"}).items() if v is not None}
        opts.update({k: v for k, v in (self.model_extra or {}).items()})
        return opts


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by chat and text completions."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)   # not OpenAI, but vLLM and others accept it
    max_tokens: int | None = Field(None, ge=1)
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    n: int = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    verispec: SpeculationOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return []
        items = [v] if isinstance(v, str) else list(v)
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        if any(not s for s in items):
            raise ValueError("stop sequences must be non-empty strings")
        return items

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, reason) for fields set to something this engine cannot honour without changing the
        output distribution; the app turns the first into a 400."""
        out = []
        if self.n != 1:
            out.append(("n", "n must be 1: this server generates one choice per request; send several requests instead"))
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                out.append((name, f"{name} is not supported (speculative decoding here keeps the model's exact distribution); leave it at 0"))
        if self.logit_bias:
            out.append(("logit_bias", "logit_bias is not supported; leave it out"))
        return out


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs or self.top_logprobs:
            out.append(("logprobs", "logprobs are not supported by this server; leave them out"))
        if self.tools:
            out.append(("tools", "tool calling is not supported by this server; leave tools out"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            out.append(("response_format", "only response_format type 'text' is supported"))
        return out

    def limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: Union[str, list[str], list[StrictInt]]   # token ids are integers: [true] is not [1]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v):
        if isinstance(v, list) and not (all(isinstance(p, str) for p in v) or
                                        all(isinstance(p, int) and not isinstance(p, bool) for p in v)):
            raise ValueError("the prompt must be a string, a list of one string, or a list of integer token ids")
        return v

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.logprobs:
            out.append(("logprobs", "logprobs are not supported by this server; leave them out"))
        if self.echo:
            out.append(("echo", "echo is not supported by this server; leave it out"))
        if self.best_of not in (None, 1):
            out.append(("best_of", "best_of must be 1"))
        if self.suffix:
            out.append(("suffix", "suffix (insertion) is not supported by this server"))
        return out

    def limit(self) -> int | None:
        return self.max_tokens


class RaceLane(SpeculationOptions):
    """One side of a race: engine options (method "ar" is plain decoding)."""


class RaceRequest(BaseModel):
    """POST /v1/verispec/race: the same prompt decoded by several methods, interleaved on one worker."""

    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    lanes: list[RaceLane] | None = Field(None, min_length=1, max_length=4)
