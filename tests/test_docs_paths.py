"""Every repository path that README.md and docs/*.md name exists: results files
(results/<machine-kind>/<topic>/...), docs pages, benchmark scripts, contributor harnesses in dev/, images,
source and test files. A path the text abbreviates (`...`) cannot be checked, so it fails too; `*` must
match a file, `{a,b}` each of its names. A path after `REV:` (as in `git show 4e9e5f7:benchmarks/x.py`)
names git history and is not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a repo path: one of the top folders, then path characters; not preceded by a path or a `REV:` prefix
PATH = re.compile(r"(?<![\w/.:-])(?:\.\./)?((?:results|docs|benchmarks|dev|verispec|tests)/[\w./*{},-]*)")


def _named(text: str) -> list[str]:
    found = []
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".,:;")
        if path.endswith("/") or "." in path.rsplit("/", 1)[-1] or "*" in path:
            found.append(path)
    return found


def _expand(path: str) -> list[str]:
    brace = re.search(r"\{([^}]*)\}", path)
    if not brace:
        return [path]
    return [p for alt in brace.group(1).split(",") for p in _expand(path[: brace.start()] + alt + path[brace.end():])]


def _exists(path: str) -> bool:
    if "..." in path:
        return False
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_the_pattern_finds_paths_and_skips_history():
    text = ("see `results/zen4/bench/x.json`, [a](docs/trees.md). `python -m dev.forward_ab` and "
            "`git show 4e9e5f7:benchmarks/old.py`; results/zen4/ and results/zen3/*.json; ../results/a/b.md")
    assert _named(text) == ["results/zen4/bench/x.json", "docs/trees.md", "results/zen4/", "results/zen3/*.json",
                            "results/a/b.md"]
    assert _expand("results/a-{1,2}.json") == ["results/a-1.json", "results/a-2.json"]
    assert not _exists("results/zen4/bench/...md") and not _exists("results/no-such-file.json")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_path_a_page_names_exists(page):
    missing = [p for named in _named(page.read_text()) for p in _expand(named) if not _exists(p)]
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


TOPICS = {"bench", "compare", "kernels", "heads", "training", "server"}


def test_results_files_sit_in_machine_kind_and_topic_folders():
    """results/<machine-kind>/<topic>/<file> (results/README.md): no file flat in results/ or a kind's folder."""
    misplaced = [p.relative_to(ROOT).as_posix() for p in (ROOT / "results").rglob("*")
                 if p.is_file() and p.name != "README.md"
                 and (len(p.relative_to(ROOT / "results").parts) != 3 or p.parent.name not in TOPICS)]
    assert not misplaced, f"results files outside results/<machine-kind>/<topic>/: {misplaced}"
