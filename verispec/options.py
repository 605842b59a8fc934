"""Speculation settings: the one object that says how an engine speculates, for the Python API, the CLI
and the server alike.

`SpeculationSettings` holds every engine option with its type, range and default: the method and the
draft schedule at the top, then one frozen sub-object per concern, each handed to the code that uses it
(the drafter factories in verispec.drafters take (target, settings) and read their own part):

    ngram      NgramSettings      prompt lookup: n-gram sizes
    suffix     SuffixSettings     suffix decoding: cross-request cache, alpha, min_prob, trie depth
    lookahead  LookaheadSettings  lookahead decoding: window, n-gram size, candidates
    tree       TreeSettings       tree shape, dynamic budget/branching/depth, verification cost curve
    backend    BackendSettings    runner: backend, exact mode, torch.compile, fast-path weights
    models     ModelSettings      what a drafter loads beside the target: draft model, trained head

Every option also has one flat name (a field's alias: `suffix_alpha`, `tree`, `tree_budget`, `backend`,
...): the keyword of build_engine/generate, the CLI's `--flag`, the key of a request's "verispec" object.
`SpeculationSettings.of(**flat)` builds the object from flat names and raises InvalidParameter with one
line saying what to change; `settings.flat()` gives them back; `settings.replace(**flat)` overrides some.

A few options hold Python objects a caller in this process may pass (a LoadedModel as `draft`, a
SuffixCache as `suffix_cache`, a StaticTree/DynamicTree as `tree`, the measured `verify_cost`); the
LOCAL_OPTIONS (draft, head, compile, weights, verify_cost) are never taken from a request. The server's
request object `SpeculationChoices` is derived from the same fields: flat, every option optional (None:
the server's default), strict JSON types only, the local options absent.

Types are strict (JSON "yes" is not a boolean, "5" not an integer). Ranges bound what one request can
cost: a draft or tree is at most a few dozen rows of one verification pass, and n-gram lookup tries at
most 32 suffix lengths per step. Relations between options (ngram_min <= ngram_max, a budget only for
dynamic trees) are judged where the engine is built.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, create_model, field_validator

from verispec.drafters import METHODS
from verispec.errors import InvalidParameter
from verispec.tree import MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_RANK, parse_tree

MAX_DRAFT_LENGTH = 64
MAX_NGRAM = 32

_Rank = Annotated[int, Field(ge=0, le=MAX_TREE_RANK)]
_TreePath = Annotated[list[_Rank], Field(min_length=1, max_length=MAX_TREE_DEPTH)]
_TreePaths = Annotated[list[_TreePath], Field(min_length=1, max_length=MAX_TREE_NODES)]
_TreeName = Annotated[str, StringConstraints(max_length=8192)]

# options a caller in this process may set but a request may not: a request naming a draft model or a
# head folder would make the server load files of the client's choosing; compiling takes minutes; the
# weights are the served model's; the verification cost curve is measured by the server
LOCAL_OPTIONS = ("draft", "head", "compile", "weights", "verify_cost")


def method_help() -> str:
    """Every method of the registry (verispec.drafters.METHODS) with its factory's summary, for help texts:
    a method added to the registry shows up in them."""
    return ", ".join(f"{name} ({fn.__doc__.strip()})" if fn.__doc__ else name for name, fn in METHODS.items())


def _printable(text: str, quote: bool = True) -> str:
    """A user's text inside a message: lone surrogates escaped (pydantic encodes messages as UTF-8)."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"'{safe}'" if quote else safe


def _known_method(v):
    if v is not None and v not in METHODS:
        raise ValueError(f"unknown method {_printable(v[:40])}; use one of: {', '.join(METHODS)}")
    return v


def _readable_tree(v):
    if v is not None:
        try:
            parse_tree(v)
        except InvalidParameter as exc:
            raise ValueError(_printable(str(exc), quote=False)) from None
    return v


class _Section(BaseModel):
    """A group of options; each field's alias is its flat name (keyword, CLI flag, request key)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


class NgramSettings(_Section):
    """method ngram (prompt lookup, verispec/drafters/ngram.py)"""

    max_n: int = Field(3, ge=1, le=MAX_NGRAM, alias="ngram_max", description="longest suffix n-gram lookup matches")
    min_n: int = Field(1, ge=1, le=MAX_NGRAM, alias="ngram_min", description="shortest suffix n-gram lookup matches")


class SuffixSettings(_Section):
    """method suffix (verispec/drafters/suffix.py); the trie depth bounds one request's index to depth x tokens
    nodes. `cache` may also be a SuffixCache object (Python API)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    cache: Literal["global", "private", "off"] = Field(
        "global", alias="suffix_cache", description="suffix: cross-request cache global (shared per model), private or off")
    alpha: float = Field(1.0, gt=0, le=64, alias="suffix_alpha", description="suffix: at most alpha x match length tokens drafted")
    min_prob: float = Field(0.1, ge=0, le=1, alias="suffix_min_prob", description="suffix: smallest path score drafted")
    depth: int = Field(24, ge=2, le=64, alias="suffix_depth", description="suffix: longest indexed substring")

    @field_validator("cache", mode="wrap")
    @classmethod
    def _cache_object(cls, v, handler):
        from verispec.drafters.suffix import SuffixCache

        return v if isinstance(v, SuffixCache) else handler(v)


class LookaheadSettings(_Section):
    """method lookahead (verispec/drafters/lookahead.py); one step verifies 1 + W x (N - 1) + G x (N - 1) rows
    at most"""

    window: int = Field(2, ge=1, le=16, alias="lookahead_window", description="lookahead: window W, tokens per level")
    ngram: int = Field(3, ge=2, le=8, alias="lookahead_ngram", description="lookahead: n-gram size N (N - 1 levels)")
    candidates: int = Field(2, ge=1, le=16, alias="lookahead_candidates",
                            description="lookahead: n-grams verified per step G")


class TreeSettings(_Section):
    """Trees (methods ngram, draft, suffix, eagle, dflash; verispec/tree): `shape` may also be a
    tree.StaticTree / tree.DynamicTree object (Python API)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    shape: Union[_TreeName, _TreePaths, None] = Field(
        None, alias="tree", description="dynamic, static:<name> (chain4, small, medium, large, xl) or a list of paths "
                                        "of sibling ranks such as [[0],[1],[0,0]]")
    budget: Union[Annotated[int, Field(ge=1, le=MAX_TREE_NODES)], Literal["auto"], None] = Field(
        None, alias="tree_budget", description="dynamic tree budget: nodes verified per step, an integer or auto")
    topk: Optional[int] = Field(None, ge=1, le=MAX_TREE_RANK + 1, alias="tree_topk", description="dynamic tree: branching")
    depth: Optional[int] = Field(None, ge=1, le=MAX_TREE_DEPTH, alias="tree_depth", description="deepest tree level")
    verify_cost: Optional[dict[int, float]] = Field(
        None, alias="verify_cost", strict=False,
        description="{positions: seconds} of one verification pass, for tree_budget auto (None: measured)")

    @field_validator("shape", mode="wrap")
    @classmethod
    def _shape(cls, v, handler):
        from verispec.tree import DynamicTree, StaticTree

        if isinstance(v, (StaticTree, DynamicTree)):
            return v
        if isinstance(v, (list, tuple)):  # paths given as tuples are the same paths
            v = [list(p) if isinstance(p, tuple) else p for p in v]
        return _readable_tree(handler(v))


class BackendSettings(_Section):
    """The runner (verispec/backends): engines that agree on these can share one."""

    name: Literal["auto", "hf", "fast"] = Field("auto", alias="backend", description="auto, hf (transformers) or fast")
    exact: Optional[bool] = Field(None, alias="exact",
                                  description="fast path: bit-identical greedy output (default: on when greedy)")
    compile: bool = Field(False, alias="compile", description="fast path: torch.compile the decode/verify passes")
    weights: Optional[str] = Field(None, alias="weights",
                                   description="fast path: auto, bf16, q8 or q4 (default: the loaded model's)")

    def runner_options(self) -> dict:
        """What Engine.for_model hands the runner (backends.fast.FastRunner)."""
        return {"exact": self.exact, "compile": self.compile, "weights": self.weights}


class ModelSettings(_Section):
    """What a drafter loads beside the target: `draft` a LoadedModel or a model name (method draft), `head` a
    trained head folder (methods eagle, medusa, dflash; None: the one shipped for the target)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    draft: Any = Field(None, alias="draft", description="draft model for method draft")
    head: Union[str, Path, None] = Field(None, alias="head", description="trained head folder (verispec train)")


class SpeculationSettings(BaseModel):
    """Every engine option with its type, range and default: what build_engine, generate/stream/
    generate_batch, `verispec generate|serve|bench` and a request's "verispec" object build."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    SECTIONS: ClassVar[tuple[str, ...]] = ("ngram", "suffix", "lookahead", "tree", "backend", "models")

    method: str = Field("ar", description="ar (plain decoding), ngram, draft, eagle, medusa, ...")
    draft_length: int = Field(5, ge=1, le=MAX_DRAFT_LENGTH, description="tokens drafted per step")
    adaptive: bool = Field(False, description="adapt the draft length to the acceptance")
    max_draft_length: int = Field(16, ge=1, le=MAX_DRAFT_LENGTH, description="longest draft of the adaptive schedule")
    ngram: NgramSettings = NgramSettings()
    suffix: SuffixSettings = SuffixSettings()
    lookahead: LookaheadSettings = LookaheadSettings()
    tree: TreeSettings = TreeSettings()
    backend: BackendSettings = BackendSettings()
    models: ModelSettings = ModelSettings()

    @field_validator("method")
    @classmethod
    def _method(cls, v):
        return _known_method(v)

    @classmethod
    @functools.cache
    def options(cls) -> dict[str, tuple[str | None, str]]:
        """flat name -> (section or None, field) for every option, in declaration order (one dict per
        class, shared: do not change it)."""
        out: dict[str, tuple[str | None, str]] = {}
        for name, field in cls.model_fields.items():
            if name in cls.SECTIONS:
                out.update({sub.alias or key: (name, key) for key, sub in field.annotation.model_fields.items()})
            else:
                out[name] = (None, name)
        return out

    @classmethod
    def field_info(cls, flat: str):
        """The pydantic FieldInfo (type, range, default, description) behind a flat name."""
        section, key = cls.options()[flat]
        model = cls.model_fields[section].annotation if section else cls
        return model.model_fields[key]

    @classmethod
    def of(cls, label=None, **flat: Any) -> "SpeculationSettings":
        """Settings from flat names (None values count as not given: the default); InvalidParameter names
        the first bad option (as label(name) when given: the CLI names its flags)."""
        known = cls.options()
        nested: dict[str, Any] = {}
        for name, value in flat.items():
            if name not in known:
                shown = label(name) if label is not None else name
                raise InvalidParameter(f"unknown option '{_printable(str(shown)[:60], quote=False)}'; "
                                       f"use one of: {', '.join(known)}")
            if value is None:
                continue
            if name == "tree_budget" and isinstance(value, str) and value.strip().isdigit():
                value = int(value)  # the CLI passes --tree-budget as text
            section, _ = known[name]
            if section is None:
                nested[name] = value
            else:
                nested.setdefault(section, {})[name] = value
        try:
            return cls.model_validate(nested)
        except ValidationError as exc:
            raise InvalidParameter(error_line(exc, label=label)[1]) from None

    def flat(self, wire: bool = False) -> dict[str, Any]:
        """flat name -> value of every option (wire: only those a request may set)."""
        out = {}
        for name, (section, key) in self.options().items():
            if not (wire and name in LOCAL_OPTIONS):
                out[name] = getattr(getattr(self, section) if section else self, key)
        return out

    def replace(self, label=None, **flat: Any) -> "SpeculationSettings":
        """These settings with some options overridden by flat name (None: keep)."""
        return self.of(label=label, **{**self.flat(), **{k: v for k, v in flat.items() if v is not None}})


def _wire_model() -> type[BaseModel]:
    """The request-facing form: every non-local option by its flat name, optional (None = the server's
    default), with the settings' types and ranges; the same validators."""
    fields = {}
    for name in SpeculationSettings.options():
        if name in LOCAL_OPTIONS:
            continue
        info = SpeculationSettings.field_info(name)
        typ = Annotated[(info.annotation,) + tuple(info.metadata)] if info.metadata else info.annotation
        fields[name] = (Optional[typ], Field(None, description=info.description))
    validators = {"known_method": field_validator("method")(lambda cls, v: _known_method(v)),
                  "readable_tree": field_validator("tree")(lambda cls, v: _readable_tree(v))}
    return create_model("SpeculationChoices", __config__=ConfigDict(extra="forbid", strict=True),
                        __doc__="The speculation options a request may choose, by flat name; None: the server's default.",
                        __validators__=validators, **fields)


SpeculationChoices = _wire_model()
WIRE_OPTIONS = tuple(SpeculationChoices.model_fields)


_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt")}


def _flat_loc(loc: tuple) -> tuple:
    """A nested settings error location as flat names: ('suffix', 'suffix_alpha') -> ('suffix_alpha',)."""
    if len(loc) > 1 and loc[0] in SpeculationSettings.SECTIONS and SpeculationSettings.options().get(loc[1], ("",))[0] == loc[0]:
        return loc[1:]
    return loc


def error_line(exc: ValidationError, label=None) -> tuple[str, str]:
    """(dotted field name, one-line message) for the first problem of a pydantic ValidationError of the
    settings or of the request form; label(field) renames the field in the message (the CLI shows its flags)."""
    errors = [{**e, "loc": _flat_loc(tuple(e.get("loc", ())))} for e in exc.errors(include_url=False)]
    first = errors[0] if errors else {}
    # a union field reports one error per branch; the branch whose type matched says what is wrong
    same = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    typed = [e for e in same if not e.get("type", "").endswith("_type") and e.get("type") != "literal_error"]
    if typed:
        first = typed[0]
    elif len(same) > 1:  # no branch took the value's type
        flat = str(first["loc"][0]) if first.get("loc") else ""
        field = SpeculationSettings.field_info(flat) if flat in SpeculationSettings.options() else None
        if field is not None and field.description:
            first = {**first, "msg": f"Value error, wrong type: expected {field.description}, got {first.get('input')!r:.60}"}
    name = ".".join(str(p) for i, p in enumerate(first.get("loc", ())) if i == 0 or isinstance(p, int))
    head, dot, rest = name.partition(".")
    shown_name = label(head) + dot + rest if label is not None and name else name
    msg = str(first.get("msg", "invalid value"))
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return name, f"unknown option '{shown_name}'"
    shown = repr(first.get("input"))
    got = f", got {shown[:60] + '...' if len(shown) > 60 else shown}"
    if msg.startswith("Value error, "):
        return name, f"{shown_name}: {msg[len('Value error, '):]}" if name else msg[len("Value error, "):]
    if kind in _BOUNDS:
        op, key = _BOUNDS[kind]
        return name, f"{shown_name} must be {op} {(first.get('ctx') or {}).get(key)}{got}"
    msg = f"{msg[0].lower()}{msg[1:]}{got}"
    return name, f"{shown_name}: {msg}" if name else msg

