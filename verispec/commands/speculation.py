"""The speculation flags of `verispec generate` and `verispec serve`, derived from the settings model.

`speculation_flags()` adds one typer option per verispec.options.SpeculationSettings option (its flat
name as `--flag`, its description and default as help) to a command, and hands the command one
validated `settings` object instead of the flags; a bad value is an InvalidParameter naming the flag
(one line, through verispec.commands.friendly). An option added to the model is a flag of every
command at once, with the model's type, range and default.
"""

from __future__ import annotations

import functools
import inspect
from typing import Optional

import typer

from verispec.options import SpeculationSettings, method_help

# options that are not flags: the verification cost curve is measured, and --weights is how a command
# loads the model (models.load_model), not a runner option
NOT_FLAGS = ("verify_cost", "weights")
SHORT = {"draft_length": "-k"}
# help beyond the model's description, where the CLI has more to say
HELP = {"method": method_help(),
        "tree": "dynamic, static:<name> (chain4, small, medium, large, xl) or static:'[[0],[1],[0,0]]'",
        "tree_budget": "dynamic tree: nodes verified per step, or 'auto' (default) to choose it from the verification "
                       "cost measured on this machine",
        "draft": "draft model for --method draft (another tokenizer than the target's works: its text is re-tokenized)"}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def label(name: str) -> str:
    """An option's name as the CLI shows it in messages."""
    return flag(name) if name in SpeculationSettings.options() else name


def _parameter(name: str) -> inspect.Parameter:
    info = SpeculationSettings.field_info(name)
    kind = info.annotation
    typ = {bool: bool, Optional[bool]: bool, int: int, Optional[int]: int, float: float}.get(kind, str)
    decls = [f"{flag(name)}/--no-{name.replace('_', '-')}" if typ is bool else flag(name)] + (
        [SHORT[name]] if name in SHORT else [])
    text = HELP.get(name, info.description or "")
    if info.default is not None:
        text += f" (default: {info.default})"
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[typ],
                             default=typer.Option(None, *decls, help=text + "."))


def speculation_flags(fn):
    """Replace `fn`'s `settings` parameter by one flag per option; fn gets SpeculationSettings.of(flags)."""
    names = [n for n in SpeculationSettings.options() if n not in NOT_FLAGS]
    sig = inspect.signature(fn, eval_str=True)  # the command module's annotations, resolved there
    own = [p for p in sig.parameters.values() if p.name != "settings"]
    flags = [_parameter(n) for n in names]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        given = {n: kwargs.pop(n) for n in names}
        return fn(settings=SpeculationSettings.of(label=label, **given), **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + flags)
    wrapper.__annotations__ = {**{p.name: p.annotation for p in own}, **{p.name: p.annotation for p in flags}}
    del wrapper.__wrapped__  # typer reads the signature above, not fn's
    return wrapper
