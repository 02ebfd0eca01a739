"""Reward functions by name: score a decoded response against the task's reference answer.

A reward function takes the decoded response text (special tokens kept) and the answer. The
response is first cut at the first `<eos>`, any `<pad>` is dropped, and it is stripped.

- `exact_match`: 1.0 if the cleaned response equals the answer, else 0.0.
- `partial_credit`: the answer and the response are aligned at their last character (units
  digit for numbers); credit = (positions where both agree) / (length of the longer one).
  It is 1.0 exactly when the response equals the answer, 0.0 for an empty response, and
  e.g. 0.5 for `"17"` against `"27"` and 2/3 for `"27"` against `"127"`.
- `math_verify`: 1.0 if Hugging Face's `math-verify` finds the response's final answer
  mathematically equal to the reference answer (`\\boxed{...}` preferred, else the last
  expression; fractions, decimals, LaTeX and equivalent forms compare by value), else 0.0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

EOS_TEXT = "<eos>"
PAD_TEXT = "<pad>"

RewardFn = Callable[[str, str], float]


def clean_response(text: str) -> str:
    """The response text up to the first `<eos>`, without `<pad>`, stripped."""
    return text.split(EOS_TEXT, 1)[0].replace(PAD_TEXT, "").strip()


def exact_match(response: str, answer: str) -> float:
    """1.0 if the cleaned response equals the stripped answer, else 0.0."""
    return 1.0 if clean_response(response) == answer.strip() else 0.0


def partial_credit(response: str, answer: str) -> float:
    """Share of right-aligned character positions where response and answer agree, in [0, 1]."""
    got, want = clean_response(response), answer.strip()
    longest = max(len(got), len(want))
    if longest == 0:
        return 1.0
    agree = sum(a == b for a, b in zip(reversed(got), reversed(want), strict=False))
    return agree / longest


# math-verify bounds its parsing and comparison with SIGALRM, which only the main thread
# may set; elsewhere it runs without a time limit (responses are at most
# model.max_response_tokens long), and its warning about that, on every call, is dropped.
MATH_VERIFY_TIMEOUT_S = 5


def _math_timeout() -> int | None:
    return MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _not_timeout_disabled(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_not_timeout_disabled)


@lru_cache(maxsize=4096)
def _parse_reference(answer: str, timeout: int | None) -> tuple[Any, ...]:
    """The reference answer as math-verify's parse: as written, else read as LaTeX math."""
    from math_verify import parse

    parsed = parse(answer, parsing_timeout=timeout) or parse(f"${answer}$", parsing_timeout=timeout)
    if not parsed:
        raise ValueError(
            f"math_verify: cannot read the reference answer {answer!r} as math; write it as "
            "a number, a fraction or LaTeX (e.g. 3/4, 0.75, \\frac{3}{4})"
        )
    return tuple(parsed)


def math_verify(response: str, answer: str) -> float:
    """1.0 if the response's final answer equals the reference answer mathematically.

    An unreadable reference answer raises ValueError; an unreadable response scores 0.0.
    """
    from math_verify import parse, verify

    timeout = _math_timeout()
    reference = list(_parse_reference(answer.strip(), timeout))
    predicted = parse(clean_response(response), parsing_timeout=timeout)
    if not predicted:
        return 0.0
    return 1.0 if verify(reference, predicted, timeout_seconds=timeout) else 0.0


REWARD_FNS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "partial_credit": partial_credit,
    "math_verify": math_verify,
}


def get_reward_fn(name: str) -> RewardFn:
    """The reward function registered as `name`; an unknown name lists the known ones."""
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise ValueError(
            f"unknown reward function {name!r} (explorer.reward_fn): known ones are "
            f"{sorted(REWARD_FNS)}"
        ) from None
