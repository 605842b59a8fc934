"""Prompt sets for benchmarks: the shipped ones (Spec-Bench public split, MT-Bench, GSM8K test,
HumanEval) and any user JSONL file whose lines carry `turns` (a list of user messages)."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from verispec.errors import InvalidParameter

DATA = Path(__file__).resolve().parent.parent / "data"

SETS = {
    "spec_bench": DATA / "spec_bench" / "question.jsonl",
    "mt_bench": DATA / "mt_bench" / "question.jsonl",
    "gsm8k": DATA / "gsm8k" / "test_minus_specbench.jsonl",
    "humaneval": DATA / "humaneval" / "HumanEval.jsonl.gz",
    "shared_tasks": DATA / "shared_tasks" / "question.jsonl",  # built by bench/shared_tasks.py
}

# Spec-Bench's speed.py reports the 8 MT-Bench categories together as one task
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


@dataclass
class Question:
    question_id: str
    category: str
    turns: list[str]
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"question_id": self.question_id, "category": self.category, "turns": self.turns}


def _read_lines(path: Path) -> list[str]:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8").splitlines()


def _from_record(rec: dict, index: int, default_category: str, where: str) -> Question:
    if "turns" in rec:
        turns = rec["turns"]
    elif "prompt" in rec:  # HumanEval: a function signature and docstring to complete
        turns = [rec["prompt"]]
    elif "question" in rec:  # GSM8K
        turns = [rec["question"]]
    else:
        raise InvalidParameter(f"{where}: a line has neither 'turns' nor 'prompt' nor 'question'")
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise InvalidParameter(f"{where}: 'turns' must be a non-empty list of non-empty strings")
    qid = rec.get("question_id", rec.get("task_id", rec.get("id", f"line{index + 1}")))
    return Question(question_id=str(qid), category=str(rec.get("category", default_category)), turns=list(turns))


def load_prompts(name_or_path: str) -> list[Question]:
    """A shipped set by name (spec_bench, mt_bench, gsm8k, humaneval) or a JSONL file path."""
    if name_or_path in SETS:
        path, default_category = SETS[name_or_path], name_or_path
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise InvalidParameter(f"unknown prompt set '{name_or_path}'; use one of {', '.join(SETS)} or a JSONL file "
                                   "with a 'turns' list per line")
        default_category = path.stem
    questions = []
    for i, line in enumerate(_read_lines(path)):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidParameter(f"{path.name} line {i + 1} is not JSON ({exc.msg})") from exc
        if not isinstance(rec, dict):
            raise InvalidParameter(f"{path.name} line {i + 1} is not a JSON object")
        questions.append(_from_record(rec, i, default_category, f"{path.name} line {i + 1}"))
    if not questions:
        raise InvalidParameter(f"{path} holds no questions")
    seen: dict[str, int] = {}
    for q in questions:  # ids label results; keep them unique
        seen[q.question_id] = seen.get(q.question_id, 0) + 1
        if seen[q.question_id] > 1:
            q.question_id = f"{q.question_id}#{seen[q.question_id]}"
    return questions


def categories(questions: list[Question]) -> list[str]:
    """Categories in order of first appearance."""
    return list(dict.fromkeys(q.category for q in questions))


def group_tasks(questions: list[Question]) -> list[Question]:
    """Spec-Bench's task grouping: the 8 MT-Bench categories become one task "mt_bench" (the original
    category is kept as extra["subcategory"]); other categories stay as they are."""
    out = []
    for q in questions:
        if q.category in MT_BENCH_CATEGORIES:
            q = Question(q.question_id, "mt_bench", q.turns, {**q.extra, "subcategory": q.category})
        out.append(q)
    return out


def sample(questions: list[Question], per_category: int | None = None, seed: int = 0,
           only: list[str] | None = None) -> list[Question]:
    """n questions per category (a seeded random choice, kept in file order); all when per_category is None."""
    if only:
        unknown = set(only) - set(categories(questions))
        if unknown:
            raise InvalidParameter(f"no questions in categories {', '.join(sorted(unknown))}; the set has "
                                   f"{', '.join(categories(questions))}")
        questions = [q for q in questions if q.category in only]
    if per_category is None:
        return list(questions)
    if per_category < 1:
        raise InvalidParameter(f"questions per category must be >= 1, got {per_category}")
    rng = random.Random(seed)
    chosen: set[int] = set()
    for cat in categories(questions):
        idx = [i for i, q in enumerate(questions) if q.category == cat]
        chosen.update(rng.sample(idx, min(per_category, len(idx))))
    return [q for i, q in enumerate(questions) if i in chosen]
