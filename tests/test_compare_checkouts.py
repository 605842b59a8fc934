"""dev/compare_checkouts.py runs each checkout's own code: a worker started from the repository root
with only PYTHONPATH set imported the root's verispec (a `-c` script puts its working directory first on
sys.path), so both sides of a comparison ran the same tree."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    return importlib.import_module("dev.compare_checkouts")


def _fake_checkout(path: Path) -> Path:
    (path / "verispec").mkdir(parents=True)
    (path / "verispec" / "__init__.py").write_text("")
    return path


def test_a_worker_imports_its_own_checkout_from_the_repository_root(tmp_path, monkeypatch):
    tree = _fake_checkout(tmp_path / "old")
    monkeypatch.chdir(ROOT)
    assert _tool().imported_from(str(tree)) == (tree / "verispec").resolve()
    # what the workers did before: PYTHONPATH alone loses to the working directory
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", "import verispec; print(verispec.__file__)"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert Path(out.strip()).resolve().parent == (ROOT / "verispec").resolve()
