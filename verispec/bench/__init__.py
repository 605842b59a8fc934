"""Benchmarks: the roofline probe, prompt sets, a Spec-Bench style harness with baselines, and reports."""

from verispec.bench.baselines import MethodSpec, parse_method
from verispec.bench.harness import run_bench
from verispec.bench.prompts import load_prompts, sample
from verispec.bench.roofline import measure as measure_roofline

__all__ = ["MethodSpec", "parse_method", "run_bench", "load_prompts", "sample", "measure_roofline"]
