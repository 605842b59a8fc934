"""`python -m verispec.fast.build`: build every kernel of verispec/csrc through ops.py's loader and print what runs.

setup.sh runs it once so that the first run does not wait for the compiler. Each kernel's row says `built`
or why not (another CPU, VERISPEC_<X>=0, a failed build: its module then runs PyTorch's operations), and the
parallel probe's row how many threads the kernels split a pass over (an OpenMP build: torch's threads).
"""

from __future__ import annotations

import torch

from verispec.fast import attend, glu, native, norm, ops, qmm, rope

OPERATORS = (qmm.OPERATOR, attend.OPERATOR, norm.OPERATOR, rope.OPERATOR, glu.OPERATOR, native.OPERATOR)


def table() -> list[tuple[str, str, str]]:
    """Build every kernel (each once per process) -> (its source in verispec/csrc, its name, built / why not)."""
    rows = [(op.source, op.name, op.available() or "built") for op in OPERATORS]
    threads = ops.parallel_threads()
    rows.append((ops.PROBE.source, "kernel threads",
                 "did not build" if threads is None else f"{threads} (torch.get_num_threads() = {torch.get_num_threads()})"))
    return rows


def main() -> None:
    rows = table()
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    print(f"verispec kernels in {ops.kernel_dir()}")
    for source, name, state in rows:
        print(f"  {source:<{width[0]}}  {name:<{width[1]}}  {state}")


if __name__ == "__main__":
    main()
