"""A whole training run through the Dagster graph, with progress and a summary.

Shared by `trinity-dagster demo` and `trinity-dagster run`. The run's Dagster instance
(SQLite) lives under `run_root/dagster_home`, so `dagster dev` on it shows every run,
materialisation and plot afterwards.
"""

import json
import os
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Any

from trinity_dagster.config import TrinityConfig
from trinity_dagster.paths import RunPaths

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_ENV_VAR = "TRINITY_DAGSTER_CONFIG"
INSTANCE_YAML = """\
# Dagster instance of one trinity-dagster run (SQLite storage in this directory).
telemetry:
  enabled: false
concurrency:
  pools:
    default_limit: 1  # runs that use the engine share the `engine` pool, one at a time
"""


def prepare_instance(config: TrinityConfig) -> Path:
    """Write the run's config and instance settings; point this process's Dagster at them."""
    paths = RunPaths.of(config.run_root)
    paths.root.mkdir(parents=True, exist_ok=True)
    paths.dagster_home.mkdir(parents=True, exist_ok=True)
    config_file = paths.root / "config.yaml"
    config_file.write_text(config.to_yaml())
    instance_yaml = paths.dagster_home / "dagster.yaml"
    if not instance_yaml.exists():
        instance_yaml.write_text(INSTANCE_YAML)
    os.environ[CONFIG_ENV_VAR] = str(config_file)
    os.environ["DAGSTER_HOME"] = str(paths.dagster_home)
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return config_file


def dagster_dev_command(config: TrinityConfig, config_file: Path) -> str:
    """The command that opens this run's instance in the Dagster UI."""
    paths = RunPaths.of(config.run_root)
    return (
        f"cd {REPO_ROOT} && DAGSTER_HOME={paths.dagster_home} {CONFIG_ENV_VAR}={config_file} "
        f"{Path(sys.executable).parent / 'dagster'} dev -w workspace.yaml -h 127.0.0.1 -p 3000"
    )


def _latest_metadata(instance: Any, asset: str, partition: str) -> dict[str, Any]:
    import dagster as dg

    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    if not records or records[0].asset_materialization is None:
        return {}
    return {k: v.value for k, v in records[0].asset_materialization.metadata.items()}


def _progress_line(instance: Any, run: Any, total_steps: int) -> str:
    step = int(run.partition) if run.partition else 0
    head = f"[{step:>3}/{total_steps}] {run.job:<16} {run.seconds:6.1f}s"
    if run.job == "rollouts_job":
        meta = _latest_metadata(instance, "rollouts", run.partition)
        kind = "demonstrations" if meta.get("demonstrations") else "rollouts"
        return (
            f"{head}  {kind}: reward {meta.get('reward_mean', float('nan')):.3f}, "
            f"weights v{meta.get('weights_version')}"
        )
    if run.job == "train_job":
        meta = _latest_metadata(instance, "train_step", run.partition)
        return (
            f"{head}  pg_loss {meta.get('actor/pg_loss', float('nan')):+.4f}, "
            f"entropy {meta.get('actor/entropy', float('nan')):.3f}, "
            f"reward {meta.get('critic/rewards/mean', float('nan')):.3f}"
        )
    return head


def run_training(config: TrinityConfig) -> dict[str, Any]:
    """Train to `trainer.total_steps` through Dagster; write and return `summary.json`."""
    config_file = prepare_instance(config)
    import dagster as dg

    from assets.driver import Driver, materialize_step, rollout_rewards
    from resources.run_config import RunConfigResource
    from trinity_dagster.checkpoint.layout import checkpoint_dir, latest_checkpoint_step
    from trinity_dagster.explorer.initial_model import create_initial_model
    from trinity_dagster.service.launcher import stop_service

    paths = RunPaths.of(config.run_root)
    total = config.trainer.total_steps
    started = time.perf_counter()
    print(f"trinity-dagster: training {total} steps under {paths.root}", flush=True)
    create_initial_model(config, paths)
    instance = dg.DagsterInstance.get()
    eval_key = f"eval/{config.explorer.eval_taskset}/accuracy"
    initial_eval = materialize_step(instance, "evaluation_job", 0)
    accuracy_start = _latest_metadata(instance, "evaluation", "000000")[eval_key]
    print(f"initial weights: {eval_key} = {accuracy_start:.3f}", flush=True)
    assert initial_eval.success

    def done() -> bool:
        trained = instance.get_materialized_partitions(dg.AssetKey("train_step"))
        saved = instance.get_materialized_partitions(dg.AssetKey("checkpoint"))
        final = f"{total:06d}"
        return final in trained and final in saved

    driver = Driver(
        instance=instance,
        run_config=RunConfigResource(config_path=str(config_file)),
        cursor_file=paths.logs / "driver_cursors.json",
        on_run=lambda run: print(_progress_line(instance, run, total), flush=True),
    )
    try:
        driver.drive(done)
        final_step = latest_checkpoint_step(paths)
        materialize_step(instance, "evaluation_job", total)
        accuracy_end = _latest_metadata(instance, "evaluation", f"{total:06d}")[eval_key]
    finally:
        stop_service(paths)
    rewards = [reward for _, reward, demo in rollout_rewards(instance) if not demo]
    window = max(1, min(5, len(rewards) // 2))
    final_ckpt = checkpoint_dir(paths, final_step) if final_step is not None else None
    hf_model = final_ckpt / "huggingface" if final_ckpt is not None else None
    summary = {
        "steps": total,
        "reward_first": fmean(rewards[:window]) if rewards else None,
        "reward_last": fmean(rewards[-window:]) if rewards else None,
        "reward_window": window,
        "accuracy_start": accuracy_start,
        "accuracy_end": accuracy_end,
        "final_checkpoint": str(final_ckpt) if final_ckpt else None,
        "hf_model": str(hf_model) if hf_model and (hf_model / "config.json").is_file() else None,
        "dagster_home": str(paths.dagster_home),
        "dagster_dev": dagster_dev_command(config, config_file),
        "seconds": round(time.perf_counter() - started, 1),
    }
    (paths.root / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        "\n".join(
            [
                "",
                f"done in {summary['seconds']:.0f} s: {total} steps",
                f"rollout reward: first {window} RL steps {summary['reward_first']} -> "
                f"last {window} {summary['reward_last']}",
                f"held-out accuracy: {accuracy_start:.3f} -> {accuracy_end:.3f}",
                f"final checkpoint: {summary['final_checkpoint']}",
                f"HF model: {summary['hf_model']}",
                f"summary: {paths.root / 'summary.json'}",
                "inspect lineage and plots:",
                f"  {summary['dagster_dev']}",
            ]
        ),
        flush=True,
    )
    return summary
