"""Measuring tools for users: decode speed against transformers, GPU roofline and bench, a trained head's
held-out figures, load and soak tests of `verispec serve`. Run from the repository root as
`python -m benchmarks.NAME --help`; the main bench is `verispec bench` (verispec/bench/)."""
