"""The summary of a finished training: the rollout reward's rise, the held-out accuracies
with their intervals, and the lineage check, as numbers and as the lines printed."""

from __future__ import annotations

from statistics import fmean, variance
from typing import Any

from trinity_dagster.config import TrinityConfig


def lineage_line(check: dict[str, Any]) -> str:
    """The summary's line on the `trained_exactly_once` check."""
    if not check["passed"]:
        return f"trained_exactly_once FAILED: {check['problems']}"
    return (
        f"trained_exactly_once passed: {check['experiences_trained']} experiences trained once, "
        f"{check['experiences_dropped']} dropped as stale, "
        f"{check['experiences_unconsumed']} not consumed (of {check['experiences_written']})"
    )


REWARD_WINDOW = 25


def rollout_reward_rise(rewards: list[float]) -> dict[str, Any]:
    """The mean rollout reward of the first and the last RL steps (`REWARD_WINDOW` steps each,
    a quarter of the steps when there are fewer than 100), and the standard error of their
    difference (None when a window has one step)."""
    window = max(1, min(REWARD_WINDOW, len(rewards) // 4))
    first, last = rewards[:window], rewards[-window:]
    se = None
    if window > 1:
        se = (variance(first) / window + variance(last) / window) ** 0.5
    return {
        "reward_first": fmean(first) if rewards else None,
        "reward_last": fmean(last) if rewards else None,
        "reward_window": window,
        "reward_rise_se": se,
    }


def reward_line(summary: dict[str, Any]) -> str:
    """The summary's line on the rollout reward."""
    first, last, window = summary["reward_first"], summary["reward_last"], summary["reward_window"]
    if first is None:
        return "rollout reward: no RL steps"
    se = summary["reward_rise_se"]
    rise = f"{last - first:+.3f}" + (f" ± {se:.3f} s.e." if se is not None else "")
    return (
        f"rollout reward: first {window} RL steps {first:.3f} -> last {window} {last:.3f} ({rise})"
    )


def held_out_accuracy(
    config: TrinityConfig, evaluations: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """`accuracy_<when>` and `accuracy_<when>_ci95` ([low, high]) from the evaluation
    metadata of each point (start, sft, end), and `eval_tasks`, the held-out set's size."""
    from trinity_dagster.tasks import taskset_name

    prefix = f"eval/{taskset_name(config.explorer.eval_taskset)}"
    out: dict[str, Any] = {}
    for when in ("start", "sft", "end"):
        meta = evaluations.get(when)
        if meta is None:
            continue
        out[f"accuracy_{when}"] = meta.get(f"{prefix}/accuracy")
        interval = [meta.get(f"{prefix}/accuracy/ci95_{end}") for end in ("low", "high")]
        out[f"accuracy_{when}_ci95"] = interval if None not in interval else None
        if f"{prefix}/tasks" in meta:
            out["eval_tasks"] = int(meta[f"{prefix}/tasks"])
    return out


def accuracy_lines(summary: dict[str, Any]) -> list[str]:
    """The summary's held-out accuracies, one line each, with their 95% intervals."""
    lines = []
    names = {"start": "before training", "sft": "after SFT", "end": "after RL"}
    for when, name in names.items():
        if f"accuracy_{when}" not in summary:
            continue
        value, interval = summary[f"accuracy_{when}"], summary[f"accuracy_{when}_ci95"]
        ci = f" (95% CI {interval[0]:.3f}-{interval[1]:.3f})" if interval else ""
        shown = f"{value:.3f}" if value is not None else "not recorded"
        lines.append(f"held-out accuracy {name}: {shown}{ci}")
    if "eval_tasks" in summary:
        lines.append(f"  (greedy, {summary['eval_tasks']} held-out tasks)")
    return lines
