"""The one loader of verispec/csrc (verispec/fast/ops.py): each install builds into its own folder, a build
killed mid-way never makes a later process wait, `python -m verispec.fast.build` reports every kernel, and no
C++ is left inside a Python file.

The build tests run the parallel probe (the smallest kernel) in a subprocess with a timeout, so that a
regression (a process polling torch's `lock` file forever) fails instead of hanging, and into a temporary
folder (VERISPEC_KERNEL_DIR), so that they do not disturb the real kernels.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from verispec.fast import ops

ROOT = Path(__file__).resolve().parents[1]
BUILD_TIMEOUT = 900  # seconds: a probe build on a busy machine takes a minute or two; a hang never ends
PROBE = ("import torch; torch.set_num_threads(1); from verispec.fast import ops; "
         "print('threads', ops.parallel_threads())")


def _need_compiler():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler here: no kernel builds")


def _env(folder: Path) -> dict:
    return {**os.environ, "VERISPEC_KERNEL_DIR": str(folder)}


def _build_probe(folder: Path) -> subprocess.CompletedProcess:
    """Build and run the probe into `folder` in a fresh process; fails the test where it does not end in time."""
    try:
        return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=_env(folder), capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the build did not finish in {BUILD_TIMEOUT} s: a later process waits on a dead build's lock")


def test_two_installs_get_two_kernel_folders(monkeypatch):
    monkeypatch.delenv("VERISPEC_KERNEL_DIR", raising=False)
    base = dict(package="/a/verispec", prefix="/a/.venv", torch_version="2.13.0+cpu", level="x86-64-v4")
    key = ops.install_key(**base)
    assert ops.install_key(**base) == key  # the same install keeps its folder
    for field, other in (("package", "/b/verispec"), ("prefix", "/b/.venv"), ("torch_version", "2.12.0+cpu"),
                         ("level", "x86-64-v3")):
        other_key = ops.install_key(**{**base, field: other})
        assert other_key != key, field
        assert ops.kernel_dir(other_key) != ops.kernel_dir(key), field
    assert ops.kernel_dir().name == ops.install_key()  # this process's own install


def test_verispec_kernel_dir_overrides_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("VERISPEC_KERNEL_DIR", str(tmp_path))
    assert ops.kernel_dir() == tmp_path
    assert ops.kernel_dir("any key") == tmp_path


def test_a_build_killed_mid_compile_leaves_a_state_the_next_process_builds_in(tmp_path):
    """A stale torch `lock` (what the kill leaves) used to make every later process wait on it forever: the next
    build removes it under its own OS lock and finishes."""
    _need_compiler()
    folder = tmp_path / ops.PROBE.name
    # its own process group: killing the group takes its compiler with it, as Ctrl-C in a terminal does
    proc = subprocess.Popen([sys.executable, "-c", PROBE], cwd=ROOT, env=_env(tmp_path), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + BUILD_TIMEOUT
        while not (folder / "lock").exists():  # torch's builder holds its lock file: the compile is under way
            assert proc.poll() is None, "the build ended before it could be killed"
            assert time.monotonic() < deadline, "the build never started"
            time.sleep(0.05)
        time.sleep(1.0)  # into the compiler's run
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (folder / "lock").exists()  # the state that used to make every later process wait forever
    done = _build_probe(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "threads 1" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert not (folder / "lock").exists()


def test_the_build_command_reports_every_kernel(capsys):
    from verispec.fast import build

    build.main()
    out = capsys.readouterr().out
    for cpp in sorted((ROOT / "verispec" / "csrc").glob("*.cpp")):
        rows = [line for line in out.splitlines() if line.split()[:1] == [cpp.name]]
        assert len(rows) == 1, (cpp.name, out)
    for op in build.OPERATORS:
        assert op.name in out
    assert str(ops.kernel_dir()) in out
    assert "kernel threads" in out


def test_every_operator_names_a_shipped_source():
    from verispec.fast import build

    shipped = {p.name for p in ops.CSRC.glob("*.cpp")}
    used = {op.source for op in build.OPERATORS} | {ops.PROBE.source}
    assert used == shipped


def test_no_cpp_is_left_inside_a_python_file():
    for path in list((ROOT / "verispec").rglob("*.py")) + list((ROOT / "benchmarks").rglob("*.py")) + list((ROOT / "dev").rglob("*.py")):
        text = path.read_text()
        for marker in ("#include <torch/", "TORCH_LIBRARY_IMPL(", "PYBIND11_MODULE("):
            assert marker not in text, f"{path.relative_to(ROOT)} holds C++ ({marker})"
