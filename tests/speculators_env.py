"""A Python environment with vLLM's `speculators` library, for the tests that load verispec's exports
with the library's own classes.

speculators 0.9.0 pins transformers <= 5.19 and verispec runs 5.25, so the library gets its own venv,
built once with pip from the package registry into <repo>/.cache/speculators-env (gitignored) and reused.
It is kept small: the CPU torch build that setup.sh installs, transformers 5.19 and only the packages
`import speculators` needs (the library itself goes in with --no-deps: its full list pulls torchvision,
torchaudio and a dataset stack that loading a checkpoint never touches).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = Path(os.environ.get("VERISPEC_SPECULATORS_ENV", REPO / ".cache" / "speculators-env"))
REQUIREMENTS = ["torch==2.13.0", "transformers==5.19.0", "safetensors", "pydantic>=2", "loguru", "openai>=2",
                "datasets>=4,<=5.1.0", "hs-connectors==0.9.0"]
LIBRARY = "speculators==0.9.0"


def python() -> Path:
    """The environment's interpreter, building the environment first when it is missing or stale."""
    exe = ENV / "bin" / "python"
    stamp = ENV / "verispec-requirements.txt"
    want = "\n".join([*REQUIREMENTS, LIBRARY]) + "\n"
    ENV.parent.mkdir(parents=True, exist_ok=True)
    with open(ENV.parent / (ENV.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; a second run waits, then finds it built
        if not (exe.is_file() and stamp.is_file() and stamp.read_text() == want):
            _build(exe, stamp, want)
    return exe


def _build(exe: Path, stamp: Path, want: str) -> None:
    print(f"building the speculators test environment in {ENV} (once; pip from the package registry)", file=sys.stderr)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(ENV)], check=True)
    pip = [str(exe), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *REQUIREMENTS], check=True)
    subprocess.run([*pip, "--no-deps", LIBRARY], check=True)
    subprocess.run([str(exe), "-c", "from speculators.models.eagle3 import Eagle3DraftModel"], check=True)
    stamp.write_text(want)


def run(script: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `script` with the environment's interpreter (one thread, like every test here)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": "", "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(python()), str(script), *args], capture_output=True, text=True, timeout=timeout, env=env)
