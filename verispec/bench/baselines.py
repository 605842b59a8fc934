"""Everything a benchmark can time, behind one small interface: verispec methods and outside baselines.

A contender turns prompt token ids into greedy output token ids (EOS not included) and, where it can,
speculation statistics. Baselines run on the same loaded model, dtype and prompt ids as verispec:
  hf           transformers generate(), plain greedy
  hf-pld       transformers assisted generation with prompt lookup (prompt_lookup_num_tokens)
  hf-assisted  transformers assisted generation with assistant_model = the draft model
  llamacpp     llama.cpp through llama-cpp-python on the model's GGUF file (only when importable), plain
  llamacpp-pld llama.cpp with its prompt-lookup speculative mode
  openai:URL   any OpenAI-compatible server (vLLM, SGLang, llama-server, verispec serve) at URL, sent the
               same prompt token ids; its streamed output is timed on this side of the socket
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass, field

import torch

from verispec.errors import InvalidParameter

BASELINES = ("hf", "hf-pld", "hf-assisted", "llamacpp", "llamacpp-pld", "openai:URL")
OPENAI = "openai:"


@dataclass
class MethodSpec:
    """A verispec method with its engine options; `options` pass through to build_engine unchanged, so
    engine options added later (trees, backends) need no change here."""

    method: str
    draft_length: int = 5
    options: dict = field(default_factory=dict)
    label: str = ""

    def __post_init__(self) -> None:
        if not self.label:
            extra = ",".join(f"{k}={v}" for k, v in self.options.items())
            self.label = self.method + (f"[{extra}]" if extra else "")


def _value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_method(spec: str, draft_length: int = 5) -> MethodSpec:
    """'ngram' or 'ngram:draft_length=4,ngram_max=3,label=pld4' -> MethodSpec."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if not name:
        raise InvalidParameter(f"empty method in '{spec}'")
    options: dict = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key.strip():
            raise InvalidParameter(f"method option '{item}' in '{spec}' is not key=value")
        options[key.strip()] = _value(val.strip())
    label = str(options.pop("label", "") or "")
    k = options.pop("draft_length", options.pop("k", draft_length))
    if not isinstance(k, int) or k < 1:
        raise InvalidParameter(f"draft_length must be an integer >= 1 in '{spec}'")
    return MethodSpec(name, draft_length=k, options=options, label=label)


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


class Contender:
    """What a bench times: a label, a kind ("verispec": a method, whose output must equal plain decoding's;
    "baseline": an outside one, reported when it fails and when it differs), and `generate`. The members
    with a body are defaults a contender may override."""

    label: str
    kind: str  # each contender class says which
    options: dict  # how it was set up, as the result records it

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], dict | None]:
        """Greedy output ids (EOS not included) and its speculation statistics (None: it has none)."""
        raise NotImplementedError

    def forget(self) -> None:
        """Drop what it keeps across generations (the default: nothing), so that the warm-up's answer to a
        measured question is not remembered."""

    def describe(self) -> dict:
        """Its method, draft length and options, as the result's config records them."""
        return {"method": None, "draft_length": None, "options": self.options}


class VerispecContender(Contender):
    """A verispec method: an engine built for `spec`."""

    kind = "verispec"

    def __init__(self, target, spec: MethodSpec, draft=None, engine=None):
        from verispec.api import build_engine
        from verispec.drafters import METHODS

        self.label, self.spec = spec.label, spec
        if engine is None:
            if spec.method not in METHODS:
                raise InvalidParameter(f"unknown method '{spec.method}'; use one of {', '.join(METHODS)}")
            try:
                # a cache of its own: two contenders on the global cache would read each other's answers to
                # the question both just answered
                options = {"suffix_cache": "private", **spec.options}
                engine = build_engine(target, spec.method, draft=draft, draft_length=spec.draft_length, **options)
            except TypeError as exc:  # an option build_engine does not take
                raise InvalidParameter(f"method '{spec.label}': {exc}") from exc
        self.engine = engine

    def generate(self, prompt_ids: list[int], max_new_tokens: int):
        from verispec.types import SamplingParams

        gen = self.engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens))
        return list(gen.token_ids), gen.stats.to_dict()

    def forget(self) -> None:
        """Drop what the drafter keeps across generations (suffix decoding's cache of earlier outputs)."""
        self.engine.forget()

    def describe(self) -> dict:
        return {"method": self.spec.method, "draft_length": self.spec.draft_length, "options": self.spec.options}


class HFContender(Contender):
    """transformers generate() on the target's own model object (greedy, batch 1)."""

    kind = "baseline"

    def __init__(self, target, label: str = "hf", prompt_lookup: int | None = None, assistant=None):
        from transformers import GenerationConfig

        self.label, self.target, self.assistant = label, target, assistant
        self.eos = target.eos_token_ids
        cfg = target.model.config
        pad = getattr(cfg, "pad_token_id", None)
        if pad is None:
            pad = min(self.eos) if self.eos else 0
        # a fresh config: the model's own generation_config may ask for sampling
        self.config = GenerationConfig(do_sample=False, num_beams=1, eos_token_id=sorted(self.eos) or None,
                                       pad_token_id=pad, prompt_lookup_num_tokens=prompt_lookup)
        self.options = {"prompt_lookup_num_tokens": prompt_lookup,
                        "assistant_model": assistant.name if assistant is not None else None}

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int):
        dev = self.target.device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=dev)
        kwargs = {}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant.model
        config = copy.deepcopy(self.config)
        config.max_new_tokens = max_new_tokens
        out = self.target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         generation_config=config, **kwargs)
        return _strip_eos(out[0, len(prompt_ids):].tolist(), self.eos), None


def llamacpp_available() -> bool:
    """True when llama_cpp imports (a build with a missing dependency is 'not installed', not a crash)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return False
    try:
        import llama_cpp  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure of a foreign package means the baseline cannot run
        return False
    return True


@contextlib.contextmanager
def _extra_buffer_types(on: bool):
    """llama.cpp's CPU backend puts weights in extra buffer types (AMX tiles, repacked Q4 blocks) by
    default. Where the AMX kernels fault (a VM that reports amx_tile but faults on ldtilecfg),
    VERISPEC_LLAMACPP_EXTRA_BUFTS=0 loads the model without them; llama-cpp-python's Llama() has no
    argument for it, so its default model parameters are adjusted for that one call."""
    if on:
        yield
        return
    import llama_cpp.llama as binding

    defaults = binding.llama_cpp.llama_model_default_params

    def without():
        params = defaults()
        params.use_extra_bufts = False
        return params

    binding.llama_cpp.llama_model_default_params = without
    try:
        yield
    finally:
        binding.llama_cpp.llama_model_default_params = defaults


def load_llamacpp(gguf_path, n_ctx: int, threads: int | None, **options):
    """llama_cpp.Llama on a GGUF file, quiet, with the extra buffer types unless
    VERISPEC_LLAMACPP_EXTRA_BUFTS=0 (see _extra_buffer_types)."""
    import llama_cpp

    with _extra_buffer_types(os.environ.get("VERISPEC_LLAMACPP_EXTRA_BUFTS", "1") != "0"):
        return llama_cpp.Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                               verbose=False, **options)


class LlamaCppContender(Contender):
    """llama.cpp on the model's GGUF file (the quantized original, so outputs may differ from the
    dequantized transformers model: a baseline for speed, not for exactness)."""

    kind = "baseline"

    def __init__(self, target, label: str = "llamacpp", prompt_lookup: int | None = None, threads: int | None = None):
        if target.gguf_path is None:
            raise InvalidParameter(f"llama.cpp needs a GGUF file; {target.name} was not loaded from one")
        draft = None
        if prompt_lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=prompt_lookup)
        self.label = label
        self.llm = load_llamacpp(target.gguf_path, min(target.context_length, 4096), threads, draft_model=draft)
        self.eos = {int(self.llm.token_eos())} | set(target.eos_token_ids)
        self.options = {"gguf": str(target.gguf_path), "prompt_lookup": prompt_lookup}

    def generate(self, prompt_ids: list[int], max_new_tokens: int):
        out: list[int] = []
        # generate(reset=True) keeps the cached tokens that match the new prompt's start (the chat template,
        # or all of a prompt run before) and skips their prefill, while verispec's contenders prefill every
        # prompt in full: cleared first, both pay the same prefill
        self.llm.reset()
        for tok in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            if tok in self.eos:
                break
            out.append(int(tok))
            if len(out) >= max_new_tokens:
                break
        return out, None


def split_baselines(text: str) -> list[str]:
    """'hf,openai:http://h:8000/v1,model=m,label=vllm,hf-pld' -> ['hf', 'openai:http://h:8000/v1,model=m,label=vllm',
    'hf-pld']: key=value items after an openai: entry are its options."""
    out: list[str] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if "=" in item and out and out[-1].startswith(OPENAI):
            out[-1] += "," + item
        else:
            out.append(item)
    return out


class OpenAIContender(Contender):
    """An OpenAI-compatible server: POST /v1/completions with the prompt as token ids, greedy, streamed.
    Its time is the client's wall time for the whole streamed answer (HTTP and the server's own queueing
    included, as a user sees it). Output token ids come from the stream where the server sends them
    (verispec serve's `verispec.token_ids`, vLLM's `token_ids` with return_token_ids); otherwise the text is
    re-encoded with the target's tokenizer, which can differ from the server's ids where tokenization is
    not unique, so the options record which one was used."""

    kind = "baseline"

    def __init__(self, spec: str, target, timeout: float = 600.0):
        rest = spec[len(OPENAI):]
        url, *items = rest.split(",")
        opts = {}
        for item in items:
            key, eq, val = item.partition("=")
            if not eq or key.strip() not in ("model", "label", "api_key"):
                raise InvalidParameter(f"openai baseline option '{item}' is not model=, label= or api_key=")
            opts[key.strip()] = val.strip()
        if not url.startswith(("http://", "https://")):
            raise InvalidParameter(f"openai baseline needs an http(s) URL, e.g. openai:http://127.0.0.1:8000/v1; got '{url}'")
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.target, self.timeout = target, timeout
        self.headers = {"Content-Type": "application/json"}
        if opts.get("api_key"):
            self.headers["Authorization"] = f"Bearer {opts['api_key']}"
        self.model = opts.get("model") or self._first_model()
        self.label = opts.get("label") or f"openai:{self.model}"
        self.eos = set(target.eos_token_ids)
        self.options = {"url": self.base, "model": self.model, "token_ids": None}

    def _request(self, path: str, body: dict | None = None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, headers=self.headers, method="GET" if body is None else "POST")
        try:
            return urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise InvalidParameter(f"{self.base}{path} answered {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise InvalidParameter(f"cannot reach {self.base}{path}: {getattr(exc, 'reason', exc)}") from None

    def _first_model(self) -> str:
        with self._request("/models") as r:
            models = json.load(r).get("data") or []
        if not models:
            raise InvalidParameter(f"{self.base}/models lists no model; give one with openai:URL,model=NAME")
        return str(models[0]["id"])

    def generate(self, prompt_ids: list[int], max_new_tokens: int):
        body = {"model": self.model, "prompt": list(prompt_ids), "max_tokens": max_new_tokens, "temperature": 0.0,
                "stream": True, "return_token_ids": True}
        text, ids, got_ids = [], [], False
        with self._request("/completions", body) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"the server sent an error mid-stream: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    text.append(choice.get("text") or "")
                    piece = choice.get("token_ids") or (chunk.get("verispec") or {}).get("token_ids")
                    if piece is not None:
                        got_ids = True
                        ids.extend(int(t) for t in piece)
        if got_ids:
            self.options["token_ids"] = "from the server"
        else:
            ids = self.target.encode(prompt="".join(text))
            self.options["token_ids"] = "re-encoded from the text"
        return _strip_eos(ids, self.eos)[:max_new_tokens], None


def make_baseline(name: str, target, draft=None, draft_length: int = 5, threads: int | None = None):
    """A baseline contender, or None (with the reason) when it cannot run here."""
    if name.startswith(OPENAI):
        return OpenAIContender(name, target), None
    if name == "hf":
        return HFContender(target, "hf"), None
    if name == "hf-pld":
        return HFContender(target, "hf-pld", prompt_lookup=draft_length), None
    if name == "hf-assisted":
        if draft is None:
            return None, "hf-assisted needs a draft model (--draft)"
        return HFContender(target, "hf-assisted", assistant=draft), None
    if name in ("llamacpp", "llamacpp-pld"):
        if not llamacpp_available():
            return None, "llama-cpp-python is not installed"
        if target.gguf_path is None:
            return None, f"{target.name} has no GGUF file"
        return LlamaCppContender(target, name, prompt_lookup=draft_length if name.endswith("pld") else None,
                                 threads=threads), None
    raise InvalidParameter(f"unknown baseline '{name}'; use any of {', '.join(BASELINES)}")
