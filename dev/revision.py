"""A kernel's C++ operator as it was at another git revision, built beside the current one in the same
process, for the kernel A/B harnesses (attend_kernel.py, qmm_kernel.py)."""

from __future__ import annotations


def op_at_revision(rev: str, path: str, op: str, build) -> object:
    """The C++ operator `op` of the module at `path` as it was at git revision `rev`, registered as
    torch.ops.verispec.<op>_at_rev beside the current one: its _SOURCE with the operator renamed, built by
    build(name, source) (the module's own loader, e.g. ops.load_for_cpu), for in-process A/B timings."""
    import subprocess
    import types

    import torch

    text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    mod = types.ModuleType(f"{op}_at_rev")
    exec(compile(text, f"{path}@{rev}", "exec"), mod.__dict__)  # noqa: S102 - the project's own source
    source = (mod._SOURCE.replace("TORCH_LIBRARY(verispec,", "TORCH_LIBRARY_FRAGMENT(verispec,")
              .replace(f'm.def("{op}(', f'm.def("{op}_at_rev(').replace(f'm.impl("{op}"', f'm.impl("{op}_at_rev"'))
    build(f"{op}_at_{rev[:12]}", source)
    return getattr(torch.ops.verispec, f"{op}_at_rev")
