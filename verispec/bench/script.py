"""What the measuring scripts (benchmarks/ and dev/, run as `python -m benchmarks.NAME` / `python -m dev.NAME`)
share: the usual options (--model, --dtype, --threads, --json) and the result file, which carries the command
line that produced it (figures live in results/<machine-kind>/<topic>/ as JSON + the command)."""

from __future__ import annotations

import argparse

from verispec.bench.report import command_line, write_json

__all__ = ["command_line", "options", "parse", "write_json"]

_UNSET = object()


def options(doc: str | None, *, model=_UNSET, dtype=_UNSET, threads=_UNSET, json=_UNSET) -> argparse.ArgumentParser:
    """A parser with the shared options whose defaults are given (json=True: --json is required)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if model is not _UNSET:
        ap.add_argument("--model", default=model)
    if dtype is not _UNSET:
        ap.add_argument("--dtype", default=dtype)
    if threads is not _UNSET:
        ap.add_argument("--threads", type=int, default=threads, help="torch CPU threads (default: torch's choice)")
    if json is not _UNSET:
        ap.add_argument("--json", required=json is True, default=None if json is True else json,
                        help="write the figures to this JSON file")
    return ap


def parse(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """Parse, and set torch's CPU threads when --threads was given."""
    args = ap.parse_args()
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)
    return args
