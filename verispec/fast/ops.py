"""The one loader of the fast path's own C++ (verispec/csrc/*.cpp): its flags, OpenMP, the build folder, the
lock, and per operator the reason where it does not run (then its module runs PyTorch's operations).

Each file is compiled with torch.utils.cpp_extension.load into a folder of this install (`kernel_dir`): the
operators (qmm, attend, norm, rope, glu) register themselves under torch.ops.verispec, the native layer step
(native.py) is a Python module. Where the build fails (no compiler, no headers) or the CPU lacks what a
kernel needs, the caller runs PyTorch's operations instead and `Operator.available()` says why.
`python -m verispec.fast.build` builds them all and prints the table of what runs.

Every operator is an OpenMP build (`-fopenmp`): ATen's `at::parallel_for` is a header template that runs its
body on the calling thread alone unless the including code is compiled with OpenMP, so without the flag every
kernel ran on one core whatever torch.set_num_threads said. The extension links `libgomp.so.1`, the
soname PyTorch's own OpenMP runtime is loaded under, so the process keeps one thread pool.
`parallel_threads()` says how many threads an operator built here runs on.

Built kernels belong to their install. Under one shared folder with fixed names, two checkouts on one machine
rebuilt each other's kernels in turn (each build.ninja names its own Python), so the folder is keyed by this
package's path, the Python prefix, the torch version and the CPU level (or VERISPEC_KERNEL_DIR). A build holds
an OS lock (flock) on a file of ours in the kernel's folder, which the kernel releases when the process dies;
under it a `lock` file of torch's builder (left behind by a build killed mid-way: torch's waiters poll it
forever) is stale and removed.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"  # the C++ sources, shipped as package data


class Flags(NamedTuple):
    """How a kernel is compiled here: the compiler flags beyond torch's (optimisation level, -march, ...) and
    what the build is for (a CPU level, an ATen capability: part of its name, so another's is never loaded)."""

    cflags: tuple[str, ...]
    tag: str = ""


@dataclass(frozen=True)
class Kernel:
    """One C++ file of verispec/csrc and how it is built."""

    source: str                 # its file name in verispec/csrc (a path elsewhere: an A/B of another revision)
    flags: Flags                # its compiler flags and what the build is for
    openmp: bool = True         # an OpenMP build (the operators: at::parallel_for runs on torch's threads)
    python_module: bool = False  # a Python module (PYBIND11_MODULE), else torch.ops registrations

    @property
    def name(self) -> str:
        """The extension's name (its .so and its folder under kernel_dir)."""
        return "verispec_" + Path(self.source).stem + (f"_{self.flags.tag}" if self.flags.tag else "")


def install_key(package: str | None = None, prefix: str | None = None, torch_version: str | None = None,
                level: str | None = None) -> str:
    """The key of this install's kernels: a hash of the package's path, the Python prefix (the venv), the
    torch version and the CPU's x86-64 level (each defaults to this process's), and the Python version."""
    parts = (package or str(Path(__file__).resolve().parent.parent), prefix or sys.prefix,
             torch_version or torch.__version__, level or x86_level(), sys.version.split()[0])
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def kernel_dir(key: str | None = None) -> Path:
    """Where this install's kernels are built: $VERISPEC_KERNEL_DIR, else kernels/<install_key> in the
    verispec cache (models.registry.cache_dir)."""
    if os.environ.get("VERISPEC_KERNEL_DIR"):
        return Path(os.environ["VERISPEC_KERNEL_DIR"]).expanduser()
    from verispec.models.registry import cache_dir

    return cache_dir() / "kernels" / (key or install_key())


_LOADING = threading.RLock()  # one build at a time in a process (torch's extension versioner is not thread-safe)


@contextmanager
def _build_lock(folder: Path):
    """An exclusive flock on folder/verispec.lock: the OS drops it when its holder dies, however it dies."""
    fd = os.open(folder / "verispec.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would let two holders lock two files)


def load(kernel: Kernel):
    """Compile (where its build is missing or stale) and load one kernel -> its Python module where it is
    one, else None (its operators are then registered under torch.ops.verispec)."""
    from torch.utils.cpp_extension import load as build

    folder = kernel_dir() / kernel.name
    folder.mkdir(parents=True, exist_ok=True)
    with _LOADING, _build_lock(folder):
        stale = folder / "lock"  # torch's FileBaton: only a dead build leaves it while we hold the flock
        if stale.exists():
            log.warning("removing %s, left by a build that did not finish", stale)
            stale.unlink(missing_ok=True)
        omp = ["-fopenmp"] if kernel.openmp else []
        mod = build(kernel.name, sources=[str(CSRC / kernel.source)], extra_cflags=list(kernel.flags.cflags) + omp,
                    extra_ldflags=omp, build_directory=str(folder), is_python_module=kernel.python_module,
                    verbose=False)
    return mod if kernel.python_module else None


class Operator:
    """One kernel as its module uses it: `available()` builds it on first call (thread-safe) -> None where it
    runs, else why; `loaded()` the Python module of a kernel that is one."""

    def __init__(self, name: str, env: str, source: str, instead: str, flags: Callable[[], Flags | str],
                 registers: tuple[str, ...] | None = None, openmp: bool = True, python_module: bool = False,
                 ready: Callable[[object], None] | None = None):
        """source: its file in verispec/csrc; env: the variable that turns it off (=0); instead: what runs
        where it does not; flags: how to compile it here, or why it cannot run here without trying;
        registers: the torch.ops.verispec operators its load defines (default: `name`); openmp,
        python_module: as Kernel's; ready: called with the loaded Python module (a set-up that must follow
        the load)."""
        self.name, self.env, self.source, self.instead = name, env, source, instead
        self._flags, self._ready, self._openmp, self._python_module = flags, ready, openmp, python_module
        self._registers = (name,) if registers is None else registers
        self._lock = threading.Lock()
        self._why: list[str | None] = []
        self._module = None

    def build(self) -> str | None:
        """Build and load it now (no memo): None, or why not."""
        return self._attempt()[0]

    def _attempt(self) -> tuple[str | None, bool]:
        """(None, or why it does not run; whether that is a failed build, a defect where a compiler is)."""
        if os.environ.get(self.env, "1") == "0":
            return f"{self.env}=0", False
        try:
            flags = self._flags()
            if isinstance(flags, str):
                return flags, False
            self._module = load(Kernel(self.source, flags, self._openmp, self._python_module))
            for op in self._registers:
                getattr(torch.ops.verispec, op)  # raises where the load did not register it
            if self._ready is not None:
                self._ready(self._module)
        except Exception as exc:  # no compiler, no headers, a failed build
            text = str(exc).strip()
            return (f"{self.name} unavailable: the kernel did not build "
                    f"({type(exc).__name__}: {text.splitlines()[-1][:120] if text else ''})"), True
        return None, False

    def available(self) -> str | None:
        with self._lock:
            if not self._why:
                why, failed = self._attempt()
                self._why.append(why)
                if why:
                    (log.warning if failed else log.info)("%s; %s", why, self.instead)
            return self._why[0]

    def loaded(self):
        """The loaded Python module (a kernel built as one), or None where it does not run."""
        return self._module if self.available() is None else None


PROBE = Kernel("parallel_probe.cpp", Flags(("-O2",)))


def parallel_threads() -> int | None:
    """The threads a kernel built here splits its work over at torch's current thread count (None where no
    operator builds): torch.get_num_threads() where the build is parallel, 1 where it is not."""
    try:
        if not hasattr(torch.ops.verispec, "parallel_threads"):
            load(PROBE)
        return int(torch.ops.verispec.parallel_threads(64))
    except Exception:  # no compiler, no headers: no kernel runs either
        return None


def for_cpu(contract: bool = True) -> Flags:
    """The flags of a kernel compiled for this CPU's x86-64 level (x86_level), named after the level so that a
    build for another CPU is never loaded; contract=False: no floating-point contraction (a kernel that
    reproduces separately rounded products and sums)."""
    level = x86_level()
    return Flags(("-O3", f"-march={level}") + (() if contract else ("-ffp-contract=off",)), level.replace("-", "_"))


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
