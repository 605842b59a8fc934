"""A kernel's C++ operator as it was at another git revision, built beside the current one in the same
process, for the kernel A/B harnesses (attend_kernel.py, qmm_kernel.py)."""

from __future__ import annotations

import subprocess
import types
from pathlib import PurePosixPath


def _git_show(rev: str, path: str) -> str | None:
    out = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def source_at(rev: str, path: str) -> str:
    """The C++ of the kernel whose Python side is `path` (verispec/fast/NAME.py) at revision `rev`: the file
    verispec/csrc/NAME.cpp where that revision has it, else (revisions before the C++ left the .py files) the
    module's _SOURCE string."""
    cpp = _git_show(rev, f"verispec/csrc/{PurePosixPath(path).stem}.cpp")
    if cpp is not None:
        return cpp
    text = _git_show(rev, path)
    if text is None:
        raise SystemExit(f"{rev} has neither verispec/csrc/{PurePosixPath(path).stem}.cpp nor {path}")
    mod = types.ModuleType(f"{PurePosixPath(path).stem}_at_rev")
    exec(compile(text, f"{path}@{rev}", "exec"), mod.__dict__)  # noqa: S102 - the project's own source
    return mod._SOURCE


def op_at_revision(rev: str, path: str, op: str, build) -> object:
    """The C++ operator `op` of the kernel at `path` as it was at git revision `rev`, registered as
    torch.ops.verispec.<op>_at_rev beside the current one: its source with the operator renamed, built by
    build(name, source) (the kernel's own loader, e.g. ops.load_for_cpu), for in-process A/B timings."""
    import torch

    source = (source_at(rev, path).replace("TORCH_LIBRARY(verispec,", "TORCH_LIBRARY_FRAGMENT(verispec,")
              .replace(f'm.def("{op}(', f'm.def("{op}_at_rev(').replace(f'm.impl("{op}"', f'm.impl("{op}_at_rev"'))
    build(f"{op}_at_{rev[:12]}", source)
    return getattr(torch.ops.verispec, f"{op}_at_rev")
