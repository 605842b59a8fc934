"""Two checkouts of verispec side by side in one run: same outputs? same speed?

For a change meant to preserve behaviour (a refactor) or to be faster, run the same generations
through two source trees (e.g. a `git worktree` of the old commit and the current one), interleaved
prompt by prompt so that a noisy shared machine slows both alike. Each checkout runs in its own worker
process (PYTHONPATH = that tree) that loads the model once and answers requests over stdin/stdout; only
the public API (`verispec.api.build_engine`, `Engine.generate`) is used, so any two versions that have it
can be compared. Each tree builds its C++ operators in a folder of its own (`extensions_dir`; the first run
of a tree builds them all, a few minutes).

    python -m dev.compare_checkouts --before /work/wt-before --after . \
        --methods ar ngram suffix lookahead eagle eagle:dynamic medusa:dynamic dflash \
        --per-task 1 --max-new-tokens 64 --dtype bfloat16 --threads 1 --json results/<machine-kind>/compare/refactor.json

Prints, per method: whether every output is token for token equal, and tokens/s of each checkout with
the after/before ratio (sum of new tokens / sum of generate time over the prompts). The ratio of one run
moves by a few percent with the order of the two workers on a prompt (the same tree measured 0.98x and
1.04x with the trees' roles swapped); `--rounds 2` runs every prompt in both orders.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from verispec.api import build_engine
from verispec.models import load_model
from verispec.types import SamplingParams
target = load_model(sys.argv[1], dtype=sys.argv[2])
engines = {}
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    key = req["method"]
    if key not in engines:
        method, _, tree = key.partition(":")
        engines[key] = build_engine(target, method=method, tree=tree or None)
        engines[key].generate(target.encode(chat="Hello"), SamplingParams(max_new_tokens=8))  # warm-up
    ids = target.encode(chat=req["prompt"])
    params = SamplingParams(max_new_tokens=req["max_new_tokens"])
    t0 = time.perf_counter()
    gen = engines[key].generate(ids, params)
    dt = time.perf_counter() - t0
    print(json.dumps({"tokens": gen.token_ids, "seconds": dt, "steps": gen.stats.steps}), flush=True)
"""


def spec_bench_prompts(per_task: int) -> list[tuple[str, str]]:
    """(task, first turn) for the first `per_task` questions of each Spec-Bench task (MT-Bench's 8
    categories count as one task, as Spec-Bench's own report groups them)."""
    path = Path(__file__).resolve().parent.parent / "verispec" / "data" / "spec_bench" / "question.jsonl"
    mt = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    out, seen = [], {}
    for line in path.read_text().splitlines():
        q = json.loads(line)
        task = "mt_bench" if q["category"] in mt else q["category"]
        if seen.get(task, 0) < per_task:
            seen[task] = seen.get(task, 0) + 1
            out.append((task, q["turns"][0]))
    return out


def extensions_dir(root: Path) -> Path:
    """Where a tree's workers build and load the C++ operators: a folder of its own per source tree. The
    operators are built under fixed names (verispec_qmm, ...); in one shared folder the two workers each
    rewrote the other's source, and one that found the other's build in progress waited for it and loaded
    it: both trees then ran one tree's kernels (and the folder kept a library older than its source)."""
    import hashlib

    key = hashlib.sha1(str(root).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / "verispec-compare-extensions" / key


def launch(tree: str, code: str, args: list[str], threads: int, **kw) -> subprocess.Popen:
    """`python -c code args` importing verispec from `tree`. It runs in the tree: a `-c` script puts its
    working directory first on sys.path, ahead of PYTHONPATH, so started elsewhere (the repository root
    of an editable install) it would import that checkout's verispec, whatever PYTHONPATH says."""
    root = Path(tree).resolve()
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS=str(threads),
               TORCH_EXTENSIONS_DIR=str(extensions_dir(root)))
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=root, text=True, **kw)


def imported_from(tree: str) -> Path:
    """The verispec package a worker for `tree` imports (checked before comparing)."""
    proc = launch(tree, "import verispec; print(verispec.__file__)", [], 1, stdout=subprocess.PIPE)
    out, _ = proc.communicate()
    return Path(out.strip()).resolve().parent


class Worker:
    def __init__(self, tree: str, model: str, dtype: str, threads: int):
        want = Path(tree).resolve() / "verispec"
        if imported_from(tree) != want:
            raise SystemExit(f"a worker for {tree} imports verispec from {imported_from(tree)}, not {want}")
        self.proc = launch(tree, WORKER, [model, dtype, str(threads)], threads, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"a worker exited early (rc {self.proc.wait()}); run it by hand to see why")
        return json.loads(line)

    def run(self, method: str, prompt: str, max_new_tokens: int) -> dict:
        self.proc.stdin.write(json.dumps({"method": method, "prompt": prompt, "max_new_tokens": max_new_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def tree_commit(tree: str) -> str | None:
    """The commit a source tree is checked out at ("+dirty" with uncommitted changes), None outside git."""
    def git(*a):
        return subprocess.run(["git", "-C", tree, *a], capture_output=True, text=True, check=True).stdout.strip()
    try:
        return git("rev-parse", "--short", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="source tree of the reference checkout")
    ap.add_argument("--after", default=".", help="source tree of the checkout under test")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", nargs="+", default=["ar", "ngram", "eagle", "eagle:dynamic"],
                    help="method or method:tree (e.g. eagle:dynamic)")
    ap.add_argument("--per-task", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=1,
                    help="runs of every prompt per checkout, the order of the two flipping each round (2: each prompt "
                         "once before-first and once after-first, so an order effect cancels)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    prompts = spec_bench_prompts(args.per_task)
    workers = {"before": Worker(args.before, args.model, args.dtype, args.threads),
               "after": Worker(args.after, args.model, args.dtype, args.threads)}
    rows = []
    t_start = time.time()
    for method in args.methods:
        sums = {name: [0, 0.0] for name in workers}
        equal = 0
        for r in range(args.rounds):
            for i, (task, prompt) in enumerate(prompts):
                order = ["before", "after"] if (i + r) % 2 == 0 else ["after", "before"]
                res = {name: workers[name].run(method, prompt, args.max_new_tokens) for name in order}
                equal += res["before"]["tokens"] == res["after"]["tokens"]
                for name in workers:
                    sums[name][0] += len(res[name]["tokens"])
                    sums[name][1] += res[name]["seconds"]
        tps = {name: sums[name][0] / sums[name][1] for name in workers}
        row = {"method": method, "prompts": len(prompts), "rounds": args.rounds, "outputs_equal": equal,
               "tok_s_before": round(tps["before"], 2), "tok_s_after": round(tps["after"], 2),
               "after_over_before": round(tps["after"] / tps["before"], 3)}
        rows.append(row)
        print(f"{method:16s} equal {equal}/{len(prompts) * args.rounds}  before {row['tok_s_before']:7.2f} tok/s  "
              f"after {row['tok_s_after']:7.2f} tok/s  ratio {row['after_over_before']:.3f}", flush=True)
    for w in workers.values():
        w.close()
    if args.json:
        from verispec.bench.environment import environment

        out = {"command": " ".join(["python", "-m", "dev.compare_checkouts"] + sys.argv[1:]), "environment": environment(),
               "trees": {name: {"path": path, "commit": tree_commit(path)} for name, path in (("before", args.before),
                                                                                             ("after", args.after))},
               "model": args.model, "dtype": args.dtype, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
               "prompts": [t for t, _ in prompts], "wall_seconds": round(time.time() - t_start, 1), "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
