"""`trinity-dagster lineage`: what trained what, from a run root.

One question per call: `--checkpoint N` (the steps, batches and producing weights behind
checkpoint N, back to the initial model), `--eid X...` (which step trained each experience, with
which weights it was produced, which checkpoint first contains it), `--weights V` (which
rollouts used weights V and which steps trained on them), or `--check` (the
`trained_exactly_once` proof; exit status 1 when it fails). The ledger is brought up to date
first. Text for people, `--json` for tools.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register `lineage (-c FILE | --run-root DIR) (--checkpoint N | --eid X | --weights V |
    --check) [--json]`."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument("-c", "--config", help="the run's YAML file (default: the demo's)")
    where.add_argument(
        "--run-root", help="the run root directory (its config.yaml names the tables' location)"
    )
    question = parser.add_mutually_exclusive_group(required=True)
    question.add_argument("--checkpoint", type=int, metavar="N", help="what led to checkpoint N")
    question.add_argument("--eid", nargs="+", metavar="X", help="where experiences X... went")
    question.add_argument("--weights", type=int, metavar="V", help="what weights V produced")
    question.add_argument(
        "--check", action="store_true", help="prove every experience was trained exactly once"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_paths(config: str | None, run_root: str | None) -> tuple[Any, int]:
    """The run's layout and its `buffer.reuse_limit`, from a config file or a run root (its
    `config.yaml`, else the defaults). Raises FileNotFoundError when it has no experiences
    table, so that nothing is created in a directory that is not a run root."""
    from trinity_dagster.buffer.tables import open_table
    from trinity_dagster.config import load_config
    from trinity_dagster.paths import RunPaths

    if run_root is not None:
        root = Path(run_root)
        if not root.is_dir():
            raise FileNotFoundError(f"no run root at {root}")
        written = root / "config.yaml"  # written by `trinity-dagster run` and `demo`
        cfg = load_config(
            written if written.is_file() else None, overrides={"run_root": str(root.resolve())}
        )
    else:
        cfg = load_config(config)
    paths = RunPaths.of_config(cfg)
    if open_table(paths.experiences) is None:
        raise FileNotFoundError(
            f"no experiences table at {paths.experiences}: {paths.root} is not a run root, or "
            "its run has not written any experience yet"
        )
    return paths, cfg.buffer.reuse_limit


def main(args: argparse.Namespace) -> int:
    """Answer one lineage question; 1 when it cannot be answered or the check fails."""
    from trinity_dagster.lineage.ledger import update_ledger
    from trinity_dagster.lineage.queries import (
        LedgerView,
        LineageQueryError,
        checkpoint_lineage,
        eid_lineage,
        weights_lineage,
    )
    from trinity_dagster.lineage.verify import verify_trained_once

    try:
        paths, reuse_limit = run_paths(args.config, args.run_root)
        if args.check:
            answer = verify_trained_once(paths, reuse_limit).as_dict()
        else:
            update_ledger(paths)
            view = LedgerView.open(paths)
            if args.checkpoint is not None:
                answer = checkpoint_lineage(view, args.checkpoint)
            elif args.eid is not None:
                answer = {"eids": eid_lineage(view, args.eid)}
            else:
                answer = weights_lineage(view, args.weights)
    except (LineageQueryError, FileNotFoundError) as err:
        print(f"trinity-dagster lineage: {err}", file=sys.stderr)
        return 1
    print(json.dumps(answer) if args.json else as_text(answer))
    return 1 if args.check and not answer["passed"] else 0


SHOWN_VERSIONS = 8  # a longer list of weights versions is summarised in text (--json has all)


def _versions(counts: dict[int, int]) -> str:
    if len(counts) <= SHOWN_VERSIONS:
        return ", ".join(f"v{v}: {n}" for v, n in counts.items()) or "none"
    most = sorted(counts.items(), key=lambda item: -item[1])[:3]
    return f"{len(counts)} versions (v{min(counts)}..v{max(counts)}); most rows from " + ", ".join(
        f"v{v}: {n}" for v, n in most
    )


def _eid_text(found: dict[str, Any]) -> str:
    rollout = found["rollout"] or {}
    made = (
        f"produced by weights v{found['model_version']} in explore step "
        f"{rollout.get('explore_step') or '?'} of {rollout.get('explorer_id', '?')}"
    )
    if found["status"] == "unconsumed":
        return f"{found['eid']}: not consumed yet (above the sampler's cursor); {made}"
    uses = ", ".join(f"step {u['step']} ({u['kind']})" for u in found["uses"])
    return (
        f"{found['eid']}: {found['status']} in {uses}; {made}; first kept checkpoint with it: "
        f"{found['first_checkpoint']}, first weights on disk with it: "
        f"{found['first_published_weights']}"
    )


def as_text(answer: dict[str, Any]) -> str:
    """The answer for people: a few lines."""
    if "checkpoint" in answer:
        n = answer["checkpoint"]
        gaps = answer["missing_steps"] + answer["steps_without_record"]
        lines = [
            f"checkpoint {n} ({answer['path']}, {'on disk' if answer['on_disk'] else 'not kept'})",
            f"  steps 1..{n} from the initial model {answer['initial_model']}: "
            + ("no gap" if not gaps else f"GAPS at {sorted(set(gaps))}"),
            f"  {answer['experiences_trained']} experiences trained, "
            f"{answer['experiences_dropped']} dropped as stale",
            f"  produced by weights {_versions(answer['by_weights_version'])}",
            f"  staleness {answer['staleness_min']}..{answer['staleness_max']} versions",
        ]
        for entry in answer["chain"][-5:]:
            lines.append(
                f"  step {entry['step']} <- step {entry['parent']}: batch table v"
                f"{entry['batch_version'] if entry['batch_version'] is not None else '?'} "
                f"(experiences v{entry['source_version']}), "
                f"{entry['trained']} trained from {_versions(entry['by_weights_version'])}"
            )
        return "\n".join(lines)
    if "eids" in answer:
        return "\n".join(_eid_text(found) for found in answer["eids"])
    if "weights_version" in answer:
        v = answer["weights_version"]
        source = "the initial model" if answer["initial_model"] else f"step {v}"
        steps = answer["steps"]
        return (
            f"weights v{v} (from {source}, {'on disk' if answer['on_disk'] else 'not kept'}): "
            f"{answer['experiences']} experiences in {len(answer['rollouts'])} rollouts; "
            f"{answer['trained']} trained in steps {min(steps, default='-')}.."
            f"{max(steps, default='-')}, {answer['dropped']} dropped as stale"
        )
    head = "trained_exactly_once: " + ("passed" if answer["passed"] else "FAILED")
    counts = ", ".join(f"{k} {v}" for k, v in answer.items() if k not in ("passed", "problems"))
    return "\n".join([head, f"  {counts}", *(f"  - {p}" for p in answer["problems"])])
