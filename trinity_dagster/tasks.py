"""Task sets by name: built-in integer arithmetic (train and held-out eval) and JSONL files.

Each built-in pair splits one fixed universe of problems by a hash of the problem text, so
the training set and its held-out set are disjoint whatever the seed; the seed only orders
the tasks.
- `two_digit_addition` / `_eval` (the demo's task): `ab+cd=` for two operands 00..99 written
  with two digits each; the 500 problems of smallest sha256 are held out.
- `arithmetic` / `_eval`: `a+b=` and `a-b=` with 0 <= a, b < 20, `a*b=` with 0 <= a, b < 10;
  about 20% held out.
- `addition` / `_eval`: single-digit `a+b=`; about 20% held out (small, for unit tests).

A JSONL task file holds one `{"task_id"?: str, "prompt": str, "answer": str}` object per line.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ADD_SUB_OPERANDS = range(20)
MUL_OPERANDS = range(10)
EVAL_SHARE_PERCENT = 20
TWO_DIGIT_OPERANDS = range(100)
TWO_DIGIT_HELD_OUT = 500


class TaskSetError(ValueError):
    """A task set name or task file is invalid; the message names the file and line."""


@dataclass(frozen=True)
class Task:
    """One prompt with its reference answer."""

    task_id: str
    prompt: str
    answer: str


@dataclass(frozen=True)
class TaskSet:
    """An ordered, non-empty collection of tasks with unique ids."""

    name: str
    tasks: tuple[Task, ...]

    def __post_init__(self) -> None:
        if not self.tasks:
            raise TaskSetError(f"task set {self.name!r} has no tasks")

    def __len__(self) -> int:
        return len(self.tasks)

    def __iter__(self) -> Iterator[Task]:
        return iter(self.tasks)

    def sample(self, n: int, rng: random.Random) -> list[Task]:
        """`n` tasks drawn without replacement; past the set's size, from fresh permutations."""
        if n < 0:
            raise ValueError(f"cannot sample a negative number of tasks ({n})")
        drawn: list[Task] = []
        while len(drawn) < n:
            drawn.extend(rng.sample(self.tasks, min(n - len(drawn), len(self.tasks))))
        return drawn

    def head(self, n: int) -> list[Task]:
        """The first `n` tasks (all of them if the set is smaller)."""
        return list(self.tasks[:n])


def _arithmetic_problems() -> list[Task]:
    problems: list[tuple[int, str, int]] = []
    for a in ADD_SUB_OPERANDS:
        for b in ADD_SUB_OPERANDS:
            problems += [(a, "+", b), (a, "-", b)]
    problems += [(a, "*", b) for a in MUL_OPERANDS for b in MUL_OPERANDS]
    results = {"+": int.__add__, "-": int.__sub__, "*": int.__mul__}
    return [Task(f"{a}{op}{b}", f"{a}{op}{b}=", str(results[op](a, b))) for a, op, b in problems]


def _digest(task: Task) -> bytes:
    return hashlib.sha256(task.task_id.encode()).digest()


def _is_held_out(task: Task) -> bool:
    return int.from_bytes(_digest(task)[:4], "big") % 100 < EVAL_SHARE_PERCENT


def _shuffled(name: str, tasks: list[Task], seed: int) -> TaskSet:
    random.Random(seed).shuffle(tasks)
    return TaskSet(name, tuple(tasks))


def arithmetic(seed: int) -> TaskSet:
    """The training split of the arithmetic problems, in an order fixed by `seed`."""
    return _shuffled("arithmetic", [t for t in _arithmetic_problems() if not _is_held_out(t)], seed)


def arithmetic_eval(seed: int) -> TaskSet:
    """The held-out split of the arithmetic problems, in an order fixed by `seed`."""
    tasks = [t for t in _arithmetic_problems() if _is_held_out(t)]
    return _shuffled("arithmetic_eval", tasks, seed)


def _addition_problems() -> list[Task]:
    return [Task(f"{a}+{b}", f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def addition(seed: int) -> TaskSet:
    """The training split of single-digit additions (the demo's task), ordered by `seed`."""
    return _shuffled("addition", [t for t in _addition_problems() if not _is_held_out(t)], seed)


def addition_eval(seed: int) -> TaskSet:
    """The held-out split of single-digit additions, ordered by `seed`."""
    tasks = [t for t in _addition_problems() if _is_held_out(t)]
    return _shuffled("addition_eval", tasks, seed)


@lru_cache(maxsize=1)
def _two_digit_addition_split() -> tuple[tuple[Task, ...], tuple[Task, ...]]:
    """(training, held-out): the `TWO_DIGIT_HELD_OUT` problems of smallest sha256 held out.

    Computed once per process: hashing and sorting the 10,000 problems takes ~30 ms, and
    the SFT warm-up loads the task set every step."""
    problems = [
        Task(f"{a:02d}+{b:02d}", f"{a:02d}+{b:02d}=", str(a + b))
        for a in TWO_DIGIT_OPERANDS
        for b in TWO_DIGIT_OPERANDS
    ]
    by_digest = sorted(problems, key=_digest)
    return tuple(by_digest[TWO_DIGIT_HELD_OUT:]), tuple(by_digest[:TWO_DIGIT_HELD_OUT])


def two_digit_addition(seed: int) -> TaskSet:
    """The training split of the two-digit additions (the demo's task), ordered by `seed`."""
    return _shuffled("two_digit_addition", list(_two_digit_addition_split()[0]), seed)


def two_digit_addition_eval(seed: int) -> TaskSet:
    """The 500 held-out two-digit additions, ordered by `seed`."""
    return _shuffled("two_digit_addition_eval", list(_two_digit_addition_split()[1]), seed)


TASKSETS: dict[str, Callable[[int], TaskSet]] = {
    "two_digit_addition": two_digit_addition,
    "two_digit_addition_eval": two_digit_addition_eval,
    "arithmetic": arithmetic,
    "arithmetic_eval": arithmetic_eval,
    "addition": addition,
    "addition_eval": addition_eval,
}


def load_jsonl_taskset(path: str | Path) -> TaskSet:
    """Tasks from a JSONL file, in file order; bad lines raise `TaskSetError` naming the line."""
    file = Path(path)
    if not file.is_file():
        raise TaskSetError(f"task file not found: {file}")
    tasks: list[Task] = []
    first_line: dict[str, int] = {}
    # lines end at "\n" only: a task's text may hold other line breaks (U+0085, U+2028)
    for number, line in enumerate(file.read_text(encoding="utf-8").split("\n"), start=1):
        if not line.strip():
            continue
        task = _parse_task_line(line, f"{file}:{number}", default_id=f"{file.stem}-{number}")
        if task.task_id in first_line:
            raise TaskSetError(
                f"{file}:{number}: duplicate task_id {task.task_id!r} "
                f"(first on line {first_line[task.task_id]})"
            )
        first_line[task.task_id] = number
        tasks.append(task)
    if not tasks:
        raise TaskSetError(f"{file}: no tasks (the file is empty)")
    return TaskSet(taskset_name(str(file)), tuple(tasks))


def _parse_task_line(line: str, where: str, default_id: str) -> Task:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise TaskSetError(f"{where}: not valid JSON ({err.msg})") from None
    if not isinstance(record, dict):
        raise TaskSetError(f"{where}: expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - {"task_id", "prompt", "answer"})
    if unknown:
        raise TaskSetError(f"{where}: unknown keys {unknown}; allowed: task_id, prompt, answer")
    for key in ("prompt", "answer"):
        if key not in record:
            raise TaskSetError(f"{where}: missing key {key!r}")
        if not isinstance(record[key], str) or not record[key]:
            raise TaskSetError(f"{where}: {key!r} must be a non-empty string, got {record[key]!r}")
    task_id = record.get("task_id", default_id)
    if not isinstance(task_id, str) or not task_id:
        raise TaskSetError(f"{where}: 'task_id' must be a non-empty string, got {task_id!r}")
    return Task(task_id, record["prompt"], record["answer"])


def taskset_name(name_or_path: str) -> str:
    """The name a task set has in metrics (`eval/<name>/...`): registered name or file stem."""
    return name_or_path if name_or_path in TASKSETS else Path(name_or_path).stem


def load_taskset(name_or_path: str, seed: int) -> TaskSet:
    """A registered task set by name (ordered by `seed`), or the tasks of a JSONL file path."""
    if name_or_path in TASKSETS:
        return TASKSETS[name_or_path](seed)
    if name_or_path.endswith(".jsonl") or Path(name_or_path).is_file():
        return load_jsonl_taskset(name_or_path)
    raise TaskSetError(
        f"unknown task set {name_or_path!r}: known ones are {sorted(TASKSETS)}, "
        "or give the path of a .jsonl file"
    )
