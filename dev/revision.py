"""A kernel's C++ operator as it was at another git revision, built beside the current one in the same
process, for the kernel A/B harnesses (dev/attend_kernel.py, dev/qmm_kernel.py)."""

from __future__ import annotations


def op_at_revision(rev: str, source: str, op: str, flags) -> object:
    """The C++ operator `op` of verispec/csrc/<source> as it was at git revision `rev` (before the C++ moved
    there: the `_SOURCE` string of verispec/fast/<the module>.py), registered as torch.ops.verispec.<op>_at_rev
    beside the current one: its source with the operator renamed, built by ops.py's loader with `flags` (an
    ops.Flags, the kernel's own), for in-process A/B timings."""
    import ast
    import subprocess
    import tempfile
    from pathlib import Path

    import torch

    from verispec.fast import ops

    def show(path: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True)

    got = show(f"verispec/csrc/{source}")
    if got.returncode == 0:
        text = got.stdout
    else:  # a revision from before verispec/csrc: the module held its C++ as a string
        module = {"native_step.cpp": "native.py"}.get(source, source.replace(".cpp", ".py"))
        old = show(f"verispec/fast/{module}")
        if old.returncode != 0:
            raise SystemExit(f"{rev} has neither verispec/csrc/{source} nor verispec/fast/{module}")
        # the string's value read without running that module (it imports the ops.py of today)
        text = next(node.value.value for node in ast.parse(old.stdout).body if isinstance(node, ast.Assign)
                    and getattr(node.targets[0], "id", None) == "_SOURCE")
    text = (text.replace("TORCH_LIBRARY(verispec,", "TORCH_LIBRARY_FRAGMENT(verispec,")
            .replace(f'm.def("{op}(', f'm.def("{op}_at_rev(').replace(f'm.impl("{op}"', f'm.impl("{op}_at_rev"'))
    path = Path(tempfile.mkdtemp()) / f"{op}_at_{rev[:12]}.cpp"
    path.write_text(text)
    ops.load(ops.Kernel(str(path), flags))
    return getattr(torch.ops.verispec, f"{op}_at_rev")
