"""Contributor harnesses: A/B timings of two checkouts or two revisions of a kernel, head diagnostics,
self-distillation, the live page's screenshots. Run from the repository root as `python -m dev.NAME --help`;
each script's docstring gives the command that produced its figures in results/."""
