"""Speculation settings: one schema (types and ranges) for the Python API, the CLI and the server.

`SpeculationSettings` lists every engine option a user may choose (method, draft length, n-gram sizes,
tree shape, backend, exact mode) with its type and range; `check_speculation(**options)` validates a
set of them and raises InvalidParameter with one line saying what to change. build_engine runs it on
its plain-valued arguments, the CLI runs it before loading a model, and the server's per-request
"verispec" object is this model (plus a timeout), so a bad value gets the same answer everywhere:
a typed exception, a one-line CLI error, a 400.

Types are strict (JSON "yes" is not a boolean, "5" not an integer). Ranges bound what one request can
cost: a draft or tree is at most a few dozen rows of one verification pass, and n-gram lookup tries at
most 32 suffix lengths per step. Relations between options that also involve defaults (ngram_min <=
ngram_max, a budget only for dynamic trees) are judged where the engine is built.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, field_validator

from verispec.drafters import METHODS
from verispec.errors import InvalidParameter
from verispec.tree import MAX_TREE_DEPTH, MAX_TREE_NODES, MAX_TREE_RANK, parse_tree

MAX_DRAFT_LENGTH = 64
MAX_NGRAM = 32

_Rank = Annotated[int, Field(ge=0, le=MAX_TREE_RANK)]
_TreePath = Annotated[list[_Rank], Field(min_length=1, max_length=MAX_TREE_DEPTH)]
_TreePaths = Annotated[list[_TreePath], Field(min_length=1, max_length=MAX_TREE_NODES)]
_TreeName = Annotated[str, StringConstraints(max_length=8192)]


def method_help() -> str:
    """Every method of the registry (verispec.drafters.METHODS) with its factory's summary, for help texts:
    a method added to the registry shows up in them."""
    return ", ".join(f"{name} ({fn.__doc__.strip()})" if fn.__doc__ else name for name, fn in METHODS.items())


def _printable(text: str, quote: bool = True) -> str:
    """A user's text inside a message: lone surrogates escaped (pydantic encodes messages as UTF-8)."""
    safe = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return f"'{safe}'" if quote else safe


class SpeculationSettings(BaseModel):
    """Engine options a user may set: for build_engine, `verispec generate` and a request's "verispec"."""

    model_config = ConfigDict(extra="forbid", strict=True)

    method: str | None = Field(None, description="ar (plain decoding), ngram, draft, eagle, medusa, ...")
    draft_length: int | None = Field(None, ge=1, le=MAX_DRAFT_LENGTH, description="tokens drafted per step")
    adaptive: bool | None = Field(None, description="adapt the draft length to the acceptance")
    max_draft_length: int | None = Field(None, ge=1, le=MAX_DRAFT_LENGTH,
                                         description="longest draft of the adaptive schedule")
    ngram_max: int | None = Field(None, ge=1, le=MAX_NGRAM, description="longest suffix n-gram lookup matches")
    ngram_min: int | None = Field(None, ge=1, le=MAX_NGRAM, description="shortest suffix n-gram lookup matches")
    tree: Union[_TreeName, _TreePaths, None] = Field(
        None, description="dynamic, static:<name> (chain4, small, medium, large, xl) or a list of paths of "
                          "sibling ranks such as [[0],[1],[0,0]]")
    tree_budget: Union[Annotated[int, Field(ge=1, le=MAX_TREE_NODES)], Literal["auto"], None] = Field(
        None, description="dynamic tree budget: nodes verified per step, an integer or auto")
    tree_topk: int | None = Field(None, ge=1, le=MAX_TREE_RANK + 1, description="dynamic tree: branching")
    tree_depth: int | None = Field(None, ge=1, le=MAX_TREE_DEPTH, description="deepest tree level")
    backend: Literal["auto", "hf", "fast"] | None = Field(None, description="auto, hf (transformers) or fast")
    exact: bool | None = Field(None, description="fast path: bit-identical greedy output (default: on when greedy)")
    # method suffix (verispec/drafters/suffix.py); the trie depth bounds one request's index to depth x tokens nodes
    suffix_cache: Literal["global", "private", "off"] | None = Field(
        None, description="suffix: cross-request cache global (shared per model), private or off")
    suffix_alpha: float | None = Field(None, gt=0, le=64, description="suffix: at most alpha x match length tokens drafted")
    suffix_min_prob: float | None = Field(None, ge=0, le=1, description="suffix: smallest path score drafted")
    suffix_depth: int | None = Field(None, ge=2, le=64, description="suffix: longest indexed substring")
    # method lookahead (verispec/drafters/lookahead.py); one step verifies 1 + W x (N - 1) + G x (N - 1) rows at most
    lookahead_window: int | None = Field(None, ge=1, le=16, description="lookahead: window W, tokens per level")
    lookahead_ngram: int | None = Field(None, ge=2, le=8, description="lookahead: n-gram size N (N - 1 levels)")
    lookahead_candidates: int | None = Field(None, ge=1, le=16,
                                             description="lookahead: n-grams verified per step G")

    @field_validator("method")
    @classmethod
    def _known_method(cls, v):
        if v is not None and v not in METHODS:
            raise ValueError(f"unknown method {_printable(v[:40])}; use one of: {', '.join(METHODS)}")
        return v

    @field_validator("tree")
    @classmethod
    def _readable_tree(cls, v):
        if v is not None:
            try:
                parse_tree(v)
            except InvalidParameter as exc:
                raise ValueError(_printable(str(exc), quote=False)) from None
        return v


_BOUNDS = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"), "greater_than": (">", "gt"),
           "less_than": ("<", "lt")}


def error_line(exc: ValidationError, label=None) -> tuple[str, str]:
    """(dotted field name, one-line message) for the first problem of a pydantic ValidationError;
    label(field) renames the field in the message (the CLI shows its flags)."""
    errors = exc.errors(include_url=False)
    first = errors[0] if errors else {}
    # a union field reports one error per branch; the branch whose type matched says what is wrong
    same = [e for e in errors if e.get("loc", ())[:1] == first.get("loc", ())[:1]]
    typed = [e for e in same if not e.get("type", "").endswith("_type") and e.get("type") != "literal_error"]
    if typed:
        first = typed[0]
    elif len(same) > 1:  # no branch took the value's type
        field = SpeculationSettings.model_fields.get(str(first["loc"][0]))
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


def check_speculation(label=None, **options: Any) -> SpeculationSettings:
    """Validate engine options (None values count as not given); InvalidParameter names the first bad
    one (as label(field) when given: the CLI names its flags)."""
    given = {k: v for k, v in options.items() if v is not None}
    if isinstance(given.get("tree_budget"), str) and given["tree_budget"].strip().isdigit():
        given["tree_budget"] = int(given["tree_budget"])  # the CLI passes --tree-budget as text
    try:
        return SpeculationSettings.model_validate(given)
    except ValidationError as exc:
        name, line = error_line(exc, label=label)
        if line.startswith("unknown option"):
            line += f"; use one of: {', '.join(SpeculationSettings.model_fields)}"
        raise InvalidParameter(line) from None
