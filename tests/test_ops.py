"""The fast path's C++ operators build wherever a compiler is: a failed build is a defect, not a reason to skip.

Each operator's own tests skip where it does not run (another CPU, no compiler); that skip also hid a kernel
whose build failed on one x86-64 level only (its .so referenced a template specialisation its source never
saw), so this test tells the two apart: on x86-64 with a C++ compiler, no operator may report a failed build.
"""

from __future__ import annotations

import platform
import shutil

import pytest

from verispec.fast import attend, glu, norm, qmm, rope

OPERATORS = {"attend": attend, "silu_mul": glu, "rms_norm": norm, "qmm": qmm, "rope_store": rope}


@pytest.mark.parametrize("name", sorted(OPERATORS))
def test_every_operator_builds_where_a_compiler_is(name, monkeypatch):
    if platform.machine() not in ("x86_64", "AMD64") or (shutil.which("c++") is None and shutil.which("g++") is None):
        pytest.skip("no x86-64 C++ toolchain here: the operators are not expected to build")
    monkeypatch.delenv(OPERATORS[name].OPERATOR.env, raising=False)
    why = OPERATORS[name].OPERATOR.build()
    assert why is None or "did not build" not in why, why


def test_the_kernels_use_the_threads_torch_is_given():
    """The operators are OpenMP builds: a kernel's at::parallel_for splits its work over torch's threads
    (built without the flag, it ran on one thread whatever torch.set_num_threads said)."""
    import os

    import torch

    from verispec.fast import ops

    if platform.machine() not in ("x86_64", "AMD64") or (shutil.which("c++") is None and shutil.which("g++") is None):
        pytest.skip("no x86-64 C++ toolchain here: the operators are not expected to build")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: a second thread cannot be asked for")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ops.parallel_threads() == 2
        torch.set_num_threads(1)
        assert ops.parallel_threads() == 1
    finally:
        torch.set_num_threads(before)
