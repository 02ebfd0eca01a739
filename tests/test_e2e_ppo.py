"""examples/ppo.yaml through the real Dagster daemon (`trinity-dagster run`), shortened: SFT
steps, the critic's warm-up, PPO steps; the critic's metrics on each step's Dagster
materialisation, the critic in the checkpoint and never in the published weights, and
`convert --critic` giving a model transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import dagster as dg
import pytest
import yaml
from safetensors import safe_open

from tests.support.dagster_dev import REPO_ROOT
from trinity_dagster.checkpoint.layout import CRITIC_DESCRIPTION_DIR, checkpoint_dir
from trinity_dagster.checkpoint.manifest import verify_checkpoint
from trinity_dagster.commands.instance_progress import metadata_values
from trinity_dagster.config import load_config
from trinity_dagster.paths import RunPaths
from trinity_dagster.step_keys import step_key
from trinity_dagster.testing import merge

pytestmark = pytest.mark.slow

STEPS, SFT_STEPS, WARMUP = 6, 2, 2
SHORTER = {
    "trainer": {"total_steps": STEPS, "sft_warmup_steps": SFT_STEPS, "save_interval": 3},
    "critic": {"warmup_steps": WARMUP},
    "buffer": {"train_batch_size": 32},
    "explorer": {"tasks_per_step": 32, "eval_tasks": 16},
}


def test_the_ppo_example_trains_through_the_daemon(tmp_path: Path) -> None:
    example = yaml.safe_load((REPO_ROOT / "examples" / "ppo.yaml").read_text())
    config_file = tmp_path / "ppo.yaml"
    config_file.write_text(
        yaml.safe_dump(merge(example, {**SHORTER, "run_root": str(tmp_path / "run")}))
    )
    binary = Path(sys.executable).parent / "trinity-dagster"
    done = subprocess.run(
        [str(binary), "run", "-c", str(config_file)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = done.stdout + done.stderr
    assert f"[{SFT_STEPS + 1:>3}/{STEPS}] train    critic warm-up, vf_loss " in printed, printed
    assert f"[{STEPS:>3}/{STEPS}] train    pg_loss " in printed and ", vf_loss " in printed
    paths = RunPaths.of(load_config(config_file).run_root)
    assert json.loads((paths.root / "summary.json").read_text())["steps"] == STEPS

    with dg.DagsterInstance.from_config(str(paths.dagster_home)) as instance:
        steps = {}
        for step in range(1, STEPS + 1):
            records = instance.fetch_materializations(
                dg.AssetRecordsFilter(
                    asset_key=dg.AssetKey("train_step"), asset_partitions=[step_key(step)]
                ),
                limit=1,
            ).records
            steps[step] = metadata_values(records[0].asset_materialization)
    for step, values in steps.items():
        if step <= SFT_STEPS:
            assert "critic/vf_loss" not in values, step
            continue
        warm = step <= SFT_STEPS + WARMUP
        assert values["critic/warmup"] == float(warm), step
        assert ("actor/pg_loss" in values) is not warm, step
        for name in ("critic/vf_loss", "critic/values/mean", "critic/vf_explained_var"):
            assert isinstance(values[name], float), (step, name)

    final = checkpoint_dir(paths, STEPS)
    verify_checkpoint(final, checksums=True)
    assert (final / CRITIC_DESCRIPTION_DIR / "config.json").is_file()
    with safe_open(final / "huggingface" / "model.safetensors", framework="pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" in names and not any(name.startswith("score.") for name in names)

    out = tmp_path / "critic_hf"
    converted = subprocess.run(
        [str(binary), "convert", "--checkpoint", str(final), "--out", str(out), "--critic"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert converted.returncode == 0, converted.stderr[-3000:]
    assert f"step {STEPS}" in converted.stdout and "(critic)" in converted.stdout
    from transformers import AutoModelForTokenClassification

    critic = AutoModelForTokenClassification.from_pretrained(out)
    assert critic.config.num_labels == 1 and critic.score.weight.shape[0] == 1
