"""What the fast path's own C++ operators (qmm.py, attend.py, norm.py, rope.py) share: one build per process, the reason
where an operator does not run, and the CPU's flags that decide it.

Each is built with torch.utils.cpp_extension.load_inline and registers itself under torch.ops.verispec;
where the build fails (no compiler, no headers) or the CPU lacks what it needs, the caller runs PyTorch's
operations instead and `Operator.available()` says why.

Every build is an OpenMP build (`-fopenmp`): ATen's `at::parallel_for` is a header template that runs its
body on the calling thread alone unless the including code is compiled with OpenMP, so without the flag every
kernel ran on one core whatever torch.set_num_threads said. The extension links `libgomp.so.1`, the
soname PyTorch's own OpenMP runtime is loaded under, so the process keeps one thread pool.
`parallel_threads()` says how many threads an operator built here runs on.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

import torch

log = logging.getLogger(__name__)


class Operator:
    """One operator: `available()` builds it on first call (thread-safe) -> None where it runs, else why."""

    def __init__(self, name: str, env: str, build: Callable[[], str | None], instead: str):
        """build: compiles and loads it (ops.load), or returns why it cannot run here without trying."""
        self.name, self.env, self._build, self.instead = name, env, build, instead
        self._lock = threading.Lock()
        self._why: list[str | None] = []

    def build(self) -> str | None:
        """Build and load it now (no memo): None, or why not."""
        if os.environ.get(self.env, "1") == "0":
            return f"{self.env}=0"
        try:
            why = self._build()
            if why:
                return why
            getattr(torch.ops.verispec, self.name)  # registered by the load
        except Exception as exc:  # no compiler, no headers, a failed build
            text = str(exc).strip()
            return f"the {self.name} kernel did not build ({type(exc).__name__}: {text.splitlines()[-1][:120] if text else ''})"
        return None

    def available(self) -> str | None:
        with self._lock:
            if not self._why:
                self._why.append(self.build())
                if self._why[0]:
                    log.info("%s; %s", self._why[0], self.instead)
            return self._why[0]


def load(name: str, source: str, cflags: list[str]) -> None:
    """Compile and load one operator's C++ (cached by torch's extension builder under `name`)."""
    from torch.utils.cpp_extension import load_inline

    load_inline(name, cpp_sources=source, extra_cflags=cflags + ["-fopenmp"], extra_ldflags=["-fopenmp"],
                is_python_module=False, verbose=False)


_PROBE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <atomic>

// how many distinct threads at::parallel_for hands work to in an operator built as the kernels are
int64_t parallel_threads(int64_t n) {
  std::atomic<uint64_t> seen{0};
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { seen |= uint64_t(1) << (at::get_thread_num() % 64); });
  return __builtin_popcountll(seen.load());
}

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("parallel_threads(int n) -> int", &parallel_threads);
}
"""


def parallel_threads() -> int | None:
    """The threads a kernel built here splits its work over at torch's current thread count (None where no
    operator builds): torch.get_num_threads() where the build is parallel, 1 where it is not."""
    try:
        if not hasattr(torch.ops.verispec, "parallel_threads"):
            load("verispec_parallel_probe", _PROBE, ["-O2"])
        return int(torch.ops.verispec.parallel_threads(64))
    except Exception:  # no compiler, no headers: no kernel runs either
        return None


def load_for_cpu(stem: str, source: str, contract: bool = True) -> None:
    """Compile and load an operator for this CPU's x86-64 level (x86_level), named after the level so that a
    build for another CPU is never loaded; contract=False: no floating-point contraction (a kernel that
    reproduces separately rounded products and sums)."""
    level = x86_level()
    load(f"verispec_{stem}_{level.replace('-', '_')}", source, ["-O3", f"-march={level}"] + ([] if contract else ["-ffp-contract=off"]))


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def x86_level() -> str:
    """The x86-64 level this CPU has (what the kernels built for "the CPU's level" are compiled for)."""
    flags = cpu_flags()
    if {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags:
        return "x86-64-v4"
    if {"avx2", "fma", "bmi2", "f16c", "movbe"} <= flags:
        return "x86-64-v3"
    return "x86-64"
