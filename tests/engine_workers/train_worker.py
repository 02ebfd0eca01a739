"""Runs a TrainEngine scenario from a JSON spec (plain, or under torchrun); writes results.

Usage: train_worker.py SPEC.json. A spec, or `runs`: a list of specs run one after the other.
Spec keys: `hf_dir`, `out`, `overrides` (dotted config keys), `steps` (batch seeds, one per
step), and optionally `load_from` (a state dir to resume from), `save_after` (step after
which to save the state into `save_dir`), `background` (save in the background),
`bad_batches` (try refused inputs first), `export_critic` (a directory to export the critic
to before the first step), `with_advantages` (try the first batch with an `advantages`
column first), `expect_error` (in `runs`: the engine's error goes to `out/error.json`).
Rank 0 writes `out/metrics.json`, `out/weights_N.pt` (HF-named tensors after step N), under
PPO `out/critic_weights_N.pt` (the critic's), and with `bad_batches`, `out/refusals.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tests.engine_workers.train_common import engine_config, make_batch, write_json
from trinity_dagster.engine.batch_check import BatchError
from trinity_dagster.engine.engine import StepOrderError, TrainEngine


def bad_batches(good: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Named broken copies of `good`."""
    cases: dict[str, dict[str, torch.Tensor]] = {}
    nan_reward = dict(good, rewards=good["rewards"].clone())
    nan_reward["rewards"][3] = float("nan")
    cases["nan_reward"] = nan_reward
    inf_old = dict(good, old_logprobs=good["old_logprobs"].clone())
    inf_old["old_logprobs"][5, 7] = float("-inf")
    cases["inf_old_logprobs"] = inf_old
    no_response = dict(good, response_mask=good["response_mask"].clone())
    no_response["response_mask"][2] = False
    cases["no_response"] = no_response
    cases["shape_mismatch"] = dict(good, rewards=good["rewards"][:-1])
    cases["empty"] = {key: value[:0] for key, value in good.items()}
    too_long = {key: value for key, value in good.items()}
    pad = torch.zeros(8, 40 - good["tokens"].shape[1], dtype=torch.bool)
    too_long["tokens"] = torch.cat([good["tokens"], pad.long()], dim=1)
    too_long["attention_mask"] = torch.cat([good["attention_mask"], pad], dim=1)
    too_long["attention_mask"][1] = True
    too_long["response_mask"] = torch.cat([good["response_mask"], pad], dim=1)
    too_long["old_logprobs"] = torch.cat([good["old_logprobs"], pad.float()], dim=1)
    cases["too_long"] = too_long
    return cases


def main() -> None:
    """Run the spec, or each spec of its `runs` in turn (one engine after the other in this
    process, which saves the imports of a process per engine)."""
    spec = json.loads(Path(sys.argv[1]).read_text())
    for run in spec.get("runs", [spec]):
        try:
            run_engine(run)
        except Exception as err:
            if not run.get("expect_error"):
                raise
            write_json(Path(run["out"]) / "error.json", {"error": str(err)})


def run_engine(spec: dict) -> None:
    """One engine's scenario."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    config = engine_config(out, **spec.get("overrides", {}))
    engine = TrainEngine(config, Path(spec["hf_dir"]))
    rank0 = engine.parallel.rank == 0
    try:
        if spec.get("load_from"):
            engine.load_state(Path(spec["load_from"]))
        if spec.get("export_critic"):
            engine.export_critic_hf(Path(spec["export_critic"]))
        if spec.get("bad_batches"):
            before = engine.hf_state_dict()
            refusals = {}
            good = make_batch(spec["steps"][0])
            for name, batch in bad_batches(good).items():
                try:
                    engine.train_step(engine.step + 1, batch)
                    refusals[name] = None
                except BatchError as err:
                    refusals[name] = str(err)
            try:
                engine.train_step(engine.step + 2, good)
                refusals["wrong_step"] = None
            except StepOrderError as err:
                refusals["wrong_step"] = str(err)
            after = engine.hf_state_dict()
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
            if rank0:
                write_json(out / "refusals.json", {"errors": refusals, "unchanged": unchanged})
                torch.save(before, out / f"weights_{engine.step}.pt")
        if spec.get("with_advantages"):
            batch = make_batch(spec["steps"][0])
            batch["advantages"] = torch.ones_like(batch["old_logprobs"])
            try:
                engine.train_step(engine.step + 1, batch)
                error = None
            except BatchError as err:
                error = str(err)
            if rank0:
                write_json(out / "refusals.json", {"errors": {"with_advantages": error}})
        metrics = []
        handle = None
        for seed in spec["steps"]:
            step = engine.step + 1
            metrics.append(engine.train_step(step, make_batch(seed)))
            weights = engine.hf_state_dict()
            if rank0:
                torch.save(weights, out / f"weights_{step}.pt")
            if engine.critic is not None:
                critic_weights = engine.critic.hf_state_dict()
                if rank0:
                    torch.save(critic_weights, out / f"critic_weights_{step}.pt")
            if spec.get("save_after") == step:
                handle = engine.save_state(
                    Path(spec["save_dir"]), background=bool(spec.get("background"))
                )
        if handle is not None:
            handle.wait()
            if rank0:
                write_json(out / "save.json", {"done": handle.done()})
        if rank0:
            write_json(out / "metrics.json", metrics)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
