"""Reward functions by name: score a decoded response against the task's reference answer.

A reward function takes the decoded response text (special tokens kept) and the answer. The
response is first cut at the first `<eos>`, any `<pad>` is dropped, and it is stripped.

- `exact_match`: 1.0 if the cleaned response equals the answer, else 0.0.
- `partial_credit`: the answer and the response are aligned at their last character (units
  digit for numbers); credit = (positions where both agree) / (length of the longer one).
  It is 1.0 exactly when the response equals the answer, 0.0 for an empty response, and
  e.g. 0.5 for `"17"` against `"27"` and 2/3 for `"27"` against `"127"`.
"""

from __future__ import annotations

from collections.abc import Callable

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


REWARD_FNS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "partial_credit": partial_credit,
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
