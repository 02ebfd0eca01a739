"""Task sets: arithmetic generation, the held-out split, sampling and JSONL task files."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from trinity_dagster.tasks import (
    TaskSetError,
    load_jsonl_taskset,
    load_taskset,
    taskset_name,
)


def reference_answer(prompt: str) -> str:
    """An independent evaluation of `a<op>b=` with Python's own arithmetic."""
    assert prompt.endswith("=")
    return str(eval(prompt[:-1], {"__builtins__": {}}))


def test_arithmetic_answers_are_right_and_fit_the_model_lengths() -> None:
    for name in ("arithmetic", "arithmetic_eval"):
        taskset = load_taskset(name, seed=0)
        for task in taskset:
            assert task.answer == reference_answer(task.prompt)
            assert len(task.prompt) + 1 <= 24  # <bos> + prompt <= model.max_prompt_tokens
            assert len(task.answer) + 1 <= 8  # answer + <eos> <= model.max_response_tokens


def test_generation_is_deterministic_per_seed() -> None:
    a, b, c = (load_taskset("arithmetic", seed) for seed in (3, 3, 4))
    assert a.tasks == b.tasks
    assert a.tasks != c.tasks
    assert set(a.tasks) == set(c.tasks)  # the seed orders, it does not choose


def test_held_out_split_is_disjoint_and_covers_all_problems() -> None:
    train = {t.prompt for t in load_taskset("arithmetic", seed=1)}
    held_out = {t.prompt for t in load_taskset("arithmetic_eval", seed=2)}
    assert not train & held_out
    assert len(train) + len(held_out) == 20 * 20 * 2 + 10 * 10
    assert 0.1 < len(held_out) / (len(train) + len(held_out)) < 0.3


def test_two_digit_addition_holds_out_a_fixed_500_of_all_10000() -> None:
    train = load_taskset("two_digit_addition", seed=1)
    held_out = load_taskset("two_digit_addition_eval", seed=2)
    assert (len(train), len(held_out)) == (9500, 500)
    prompts = {t.prompt for t in train} | {t.prompt for t in held_out}
    assert prompts == {f"{a:02d}+{b:02d}=" for a in range(100) for b in range(100)}
    assert {t.prompt for t in load_taskset("two_digit_addition_eval", seed=7)} == {
        t.prompt for t in held_out
    }  # the seed orders the held-out set, it does not choose it
    for task in [*train.tasks[:200], *held_out]:
        a, b = task.prompt[:-1].split("+")
        assert task.answer == str(int(a) + int(b))
        assert len(task.prompt) + 1 <= 24 and len(task.answer) + 1 <= 8  # the demo's lengths


def test_sample_is_deterministic_without_replacement_and_cycles() -> None:
    taskset = load_taskset("arithmetic_eval", seed=0)
    first = taskset.sample(10, random.Random(7))
    assert first == taskset.sample(10, random.Random(7))
    assert len(set(first)) == 10
    many = taskset.sample(len(taskset) + 5, random.Random(7))
    assert set(many[: len(taskset)]) == set(taskset.tasks)
    assert taskset.head(3) == list(taskset.tasks[:3])


def write_lines(tmp_path: Path, lines: list[str], name: str = "mine.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_taskset_reads_ids_and_defaults(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path,
        [
            json.dumps({"task_id": "a", "prompt": "1+1=", "answer": "2"}),
            "",
            json.dumps({"prompt": "what is two?", "answer": "2"}),
        ],
    )
    taskset = load_taskset(str(path), seed=0)
    assert taskset.name == taskset_name(str(path)) == "mine"
    assert taskset_name("arithmetic_eval") == load_taskset("arithmetic_eval", 0).name
    assert [(t.task_id, t.prompt, t.answer) for t in taskset] == [
        ("a", "1+1=", "2"),
        ("mine-3", "what is two?", "2"),
    ]


def test_a_task_whose_text_holds_unicode_line_breaks_is_one_line(tmp_path: Path) -> None:
    prompt = "one\x85two\u2028three="
    line = json.dumps({"task_id": "a", "prompt": prompt, "answer": "3"}, ensure_ascii=False)
    taskset = load_taskset(str(write_lines(tmp_path, [line])), seed=0)
    assert [(t.task_id, t.prompt) for t in taskset] == [("a", prompt)]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "1=", "answer": "1"}', "{oops"], r"mine\.jsonl:2: not valid JSON"),
        (['{"answer": "1"}'], r"mine\.jsonl:1: missing key 'prompt'"),
        (['{"prompt": "1=", "answer": 1}'], r"mine\.jsonl:1: 'answer' must be a non-empty string"),
        (['{"prompt": "", "answer": "1"}'], r":1: 'prompt' must be a non-empty string"),
        (['["1=", "1"]'], r":1: expected a JSON object, got list"),
        (['{"prompt": "1=", "answer": "1", "hint": "x"}'], r":1: unknown keys \['hint'\]"),
        (['{"task_id": 5, "prompt": "1=", "answer": "1"}'], r":1: 'task_id' must be"),
        (
            ['{"task_id": "x", "prompt": "1=", "answer": "1"}'] * 2,
            r":2: duplicate task_id 'x' \(first on line 1\)",
        ),
        (["", "  "], r"mine\.jsonl: no tasks"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, lines: list[str], message: str) -> None:
    path = write_lines(tmp_path, lines)
    with pytest.raises(TaskSetError, match=message):
        load_jsonl_taskset(path)


def test_unknown_name_and_missing_file() -> None:
    with pytest.raises(TaskSetError, match=r"unknown task set 'gsm8k'.*'arithmetic'"):
        load_taskset("gsm8k", seed=0)
    with pytest.raises(TaskSetError, match=r"task file not found: /nonexistent/t\.jsonl"):
        load_taskset("/nonexistent/t.jsonl", seed=0)


def test_tasks_and_rewards_import_no_torch() -> None:
    code = (
        "import sys, trinity_dagster.tasks, trinity_dagster.explorer.rewards; "
        "print(sorted(m for m in ('torch', 'transformers', 'dagster') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
