"""A prompt set whose requests share structure: the same task asked over many inputs, as agent
pipelines and batch jobs send them (the workload suffix decoding targets; Oliaro et al. 2024).

Four tasks, eight inputs each, built from the shipped GSM8K-test (minus Spec-Bench) and HumanEval
texts, so no Spec-Bench question is used: each task is a fixed instruction with a fixed output format
around a different input. A task's questions come one after another in the file, so a method with a
cross-request memory sees the earlier answers of the same task before each new one.

`python -m verispec.bench.shared_tasks` rewrites verispec/data/shared_tasks/question.jsonl from the
shipped files (deterministic: the first inputs in file order).
"""

from __future__ import annotations

import json
from pathlib import Path

from verispec.bench.prompts import DATA, load_prompts

PER_TASK = 8
OUT = DATA / "shared_tasks" / "question.jsonl"

TASKS = {
    "gsm8k_json": ("gsm8k", 0, (
        "Extract every quantity mentioned in the problem below as a JSON list of objects with the keys "
        "\"name\", \"value\" and \"unit\". Answer with the JSON list only.\n\nProblem: {x}")),
    "gsm8k_steps": ("gsm8k", PER_TASK, (
        "Solve the problem below. Use exactly this format, one step per line:\nStep 1: ...\nStep 2: ...\n"
        "Answer: <number>\n\nProblem: {x}")),
    "code_docstring": ("humaneval", 0, (
        "Write a Google-style docstring for the function below, with a one-line summary, an Args: section "
        "and a Returns: section. Reply with the docstring only.\n\n{x}")),
    "code_tests": ("humaneval", PER_TASK, (
        "Write three assert statements that test the function below. Reply with the three lines only, each "
        "starting with \"assert\".\n\n{x}")),
}


def build() -> list[dict]:
    out = []
    for task, (source, start, template) in TASKS.items():
        inputs = load_prompts(source)[start: start + PER_TASK]
        for i, q in enumerate(inputs):
            out.append({"question_id": f"{task}-{i + 1}", "category": task,
                        "turns": [template.format(x=q.turns[0].strip())], "source": f"{source}:{q.question_id}"})
    return out


def write(path: Path = OUT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build()), encoding="utf-8")
    return path


if __name__ == "__main__":
    print(write())
