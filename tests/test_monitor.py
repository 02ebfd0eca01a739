"""`monitor.backends`: every train step's metrics reach TensorBoard, MLflow and a JSONL file.

What each backend wrote is read back with that tool's own reader (tensorboard's
`EventAccumulator`, the `mlflow` client, `json`) and compared with what the trainer hook, the
Dagster side's record, received. The fast tests drive `Trainer` over the fake engine of
`test_trainer_loop`; one short real run drives it over the engine service and also checks the
final HF model that MLflow keeps.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from mlflow import MlflowClient
from mlflow.entities import Run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2 as pb

import trinity_dagster.testing as testing
from tests.test_trainer_loop import FakeEngine, RecordingHook
from trinity_dagster.buffer.reader import load_step_batch
from trinity_dagster.checkpoint.layout import HF_SUBDIR, checkpoint_dir
from trinity_dagster.config import ConfigError, TrinityConfig, config_from_dict
from trinity_dagster.handoff.trainer_state import read_trainer_state
from trinity_dagster.monitor import Monitor, MonitorError, MonitorGroup
from trinity_dagster.monitor.base import markdown_table
from trinity_dagster.paths import RunPaths
from trinity_dagster.service.launcher import stop_service
from trinity_dagster.testing import fill_buffer, tiny_config
from trinity_dagster.tokenizer import build_tokenizer
from trinity_dagster.trainer import SyncWithheldError, Trainer
from trinity_dagster.trainer.preview import TABLE as PREVIEW

ALL_BACKENDS = ["tensorboard", "mlflow", "jsonl", "wandb"]
StepMetrics = dict[int, dict[str, float]]


@pytest.fixture(autouse=True)
def _no_mlflow_telemetry(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLflow would otherwise try to send usage data; these tests stay on this machine."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


@pytest.fixture
def fake_vocab(monkeypatch: pytest.MonkeyPatch) -> None:
    """Synthetic experiences for the fake engine need only a vocabulary size."""
    monkeypatch.setattr(testing, "vocab_size", lambda config: 96)


def monitored_config(
    tmp_path: Path,
    backends: list[str],
    total_steps: int,
    save_hf_checkpoint: str = "last",
    **monitor: Any,
) -> TrinityConfig:
    trainer = {
        "total_steps": total_steps,
        "save_interval": 0,
        "save_hf_checkpoint": save_hf_checkpoint,
    }
    extra = {
        "trainer": trainer,
        "buffer": {"read_timeout_s": 60.0},
        "monitor": {"backends": backends, **monitor},
    }
    return tiny_config(tmp_path, extra)[0]


def tensorboard_steps(run_root: Path) -> StepMetrics:
    """Every scalar of the event files under `logs/tensorboard/`, by step."""
    events = EventAccumulator(str(run_root / "logs" / "tensorboard")).Reload()
    steps: StepMetrics = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            steps.setdefault(event.step, {})[tag] = event.value
    return steps


def mlflow_run(config: TrinityConfig) -> tuple[MlflowClient, Run]:
    """The client of the run root's default MLflow store, and its one run."""
    store = Path(config.run_root, "logs", "mlflow", "mlflow.db")
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name(config.project)
    assert experiment is not None, f"no MLflow experiment {config.project!r} in {store}"
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, runs
    return client, runs[0]


def mlflow_steps(client: MlflowClient, run: Run) -> StepMetrics:
    """Every metric of the MLflow run, by step."""
    steps: StepMetrics = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            steps.setdefault(metric.step, {})[key] = metric.value
    return steps


def wandb_records(run_root: Path) -> list[pb.Record]:
    """The records of the run root's one offline W&B run, read from its `.wandb` file: a
    LevelDB-style log (a 7-byte `:W&B` header, then 32 KiB blocks of chunks, each with a
    crc32, a length and a type: 1 whole, 2 first, 3 middle, 4 last) of `Record` protobufs."""
    (file,) = (run_root / "logs" / "wandb").glob("offline-run-*/run-*.wandb")
    data = file.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    records, pending, at = [], b"", 7
    while at + 7 <= len(data):
        block_left = 32768 - at % 32768
        if block_left < 7:  # a block's tail too short for a chunk header is padding
            at += block_left
            continue
        length, kind = int.from_bytes(data[at + 4 : at + 6], "little"), data[at + 6]
        if kind == 0 and length == 0:
            break  # zero padding: the end of what was written
        chunk, at = data[at + 7 : at + 7 + length], at + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_steps(run_root: Path) -> StepMetrics:
    """Every scalar logged to the offline W&B run, by step."""
    steps: StepMetrics = {}
    for record in wandb_records(run_root):
        if record.WhichOneof("record_type") != "history":
            continue
        # a metric has one key ("actor/pg_loss"); a logged table's summary is a nested one
        items = {
            item.key or item.nested_key[0]: item.value_json
            for item in record.history.item
            if item.key or len(item.nested_key) == 1
        }
        step = int(json.loads(items.pop("_step")))
        for key, value in items.items():
            value = json.loads(value)
            if not key.startswith("_") and isinstance(value, int | float):
                steps.setdefault(step, {})[key] = value
    return steps


def jsonl_lines(run_root: Path) -> list[dict[str, Any]]:
    lines = (run_root / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def hook_steps(hook: RecordingHook) -> dict[int, Mapping[str, Any]]:
    return dict(zip(hook.steps, hook.metrics, strict=True))


def assert_config_params(run: Run, config: TrinityConfig) -> None:
    params = run.data.params
    assert params["trainer.total_steps"] == str(config.trainer.total_steps)
    assert params["trainer.optim.lr"] == str(config.trainer.optim.lr)
    assert params["model.hidden_size"] == str(config.model.hidden_size)
    assert params["monitor.backends"] == str(config.monitor.backends)
    assert params["run_root"] == config.run_root
    assert {key.split(".")[0] for key in params} >= set(TrinityConfig.model_fields)


@pytest.mark.parametrize(
    ("monitor", "key", "says"),
    [
        (
            {"backends": ["neptune"]},
            "monitor.backends.0",
            "'tensorboard', 'mlflow', 'jsonl' or 'wandb'",
        ),
        ({"wandb_mode": "cloud"}, "monitor.wandb_mode", "'offline' or 'online'"),
        ({"backends": ["jsonl", "jsonl"]}, "monitor.backends", "jsonl listed more than once"),
        ({"metrics_file": True}, "monitor.metrics_file", "unknown key"),
    ],
)
def test_unknown_and_unsupported_settings_are_refused(
    monitor: dict[str, Any], key: str, says: str
) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_dict({"monitor": monitor}, "run.yaml")
    assert f"{key}: " in str(err.value) and says in str(err.value)


def test_each_step_reaches_every_backend_as_the_hook_received_it(
    tmp_path: Path, fake_vocab: None
) -> None:
    # the fake engine writes no HF export: no final model for MLflow
    config = monitored_config(tmp_path, ALL_BACKENDS, total_steps=3, save_hf_checkpoint="never")
    fill_buffer(config, 3)
    hook = RecordingHook()

    asyncio.run(Trainer(config, engine=FakeEngine(), hook=hook).run())

    root = Path(config.run_root)
    expected = hook_steps(hook)
    assert list(expected) == [1, 2, 3]
    assert all("actor/pg_loss" in metrics for metrics in expected.values())
    tensorboard = tensorboard_steps(root)
    assert tensorboard.keys() == expected.keys()
    for step, metrics in expected.items():  # event files keep float32
        assert tensorboard[step] == pytest.approx(metrics, rel=1e-6), step
    client, run = mlflow_run(config)
    assert mlflow_steps(client, run) == expected
    assert run.info.status == "FINISHED"
    assert_config_params(run, config)
    assert jsonl_lines(root) == [{"step": s, "metrics": m} for s, m in expected.items()]
    assert wandb_steps(root) == expected


class PreviewHook(RecordingHook):
    def __init__(self) -> None:
        super().__init__()
        self.previews: list[tuple[int, list[dict[str, Any]]]] = []

    def on_preview(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.previews.append((step, rows))


def expected_preview(config: TrinityConfig, steps: list[int], tokenizer: Any) -> list[dict]:
    """The lowest- and highest-reward pinned row of each step, decoded by transformers."""
    expected = []
    for step in steps:
        rows = load_step_batch(config, step)
        rewards = rows.column("reward").to_pylist()
        for i in (rewards.index(min(rewards)), rewards.index(max(rewards))):
            tokens = rows.column("tokens")[i].as_py()
            split = rows.column("prompt_length")[i].as_py()
            expected.append(
                {
                    "step": step,
                    "prompt": tokenizer.decode(tokens[:split], skip_special_tokens=True),
                    "response": tokenizer.decode(tokens[split:], skip_special_tokens=True),
                    "reward": rewards[i],
                }
            )
    return expected


def test_the_rollout_preview_reaches_every_backend_that_keeps_tables(
    tmp_path: Path, fake_vocab: None
) -> None:
    """`trainer.enable_preview`: every `sync_interval` (2) steps the table `rollout_examples`
    of the steps since the last one goes to MLflow (an artifact in its table format),
    TensorBoard (the Text tab) and the hook (the step's Dagster materialisation)."""
    config = monitored_config(tmp_path, ALL_BACKENDS, total_steps=5, save_hf_checkpoint="never")
    config.synchronizer.sync_interval = 2
    tokenizer = build_tokenizer(RunPaths.of_config(config).tokenizer)  # as the run writes it
    fill_buffer(config, 5)
    hook = PreviewHook()

    asyncio.run(Trainer(config, engine=FakeEngine(), hook=hook).run())

    first, second = (
        expected_preview(config, [1, 2], tokenizer),
        expected_preview(config, [3, 4], tokenizer),
    )
    assert hook.previews == [(2, first), (4, second)]  # step 5's waits for step 6
    client, run = mlflow_run(config)
    saved = client.download_artifacts(run.info.run_id, "rollout_examples.json", str(tmp_path))
    table = json.loads(Path(saved).read_text())
    assert table["columns"] == ["step", "prompt", "response", "reward"]
    assert table["data"] == [[row[c] for c in table["columns"]] for row in first + second]
    events = EventAccumulator(
        str(tmp_path / "run" / "logs" / "tensorboard"), size_guidance={"tensors": 0}
    ).Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(PREVIEW)}
    assert texts == {2: markdown_table(first), 4: markdown_table(second)}
    wandb_tables = sorted(
        (tmp_path / "run" / "logs" / "wandb").glob("offline-run-*/files/media/table/*.json"),
        key=lambda file: int(file.name.split("_")[2]),  # rollout_examples_<step>_<hash>
    )
    logged = [json.loads(file.read_text()) for file in wandb_tables]
    assert [table["data"] for table in logged] == [
        [[row[c] for c in table["columns"]] for row in rows]
        for table, rows in zip(logged, (first, second), strict=True)
    ]


@pytest.mark.parametrize(
    ("backends", "not_imported"),
    [
        ([], {"mlflow", "tensorboard", "torch"}),
        (["jsonl"], {"mlflow", "tensorboard", "torch"}),
        (["tensorboard", "jsonl"], {"mlflow", "torch"}),  # the default: no torch in the trainer
    ],
)
def test_a_run_imports_only_the_trackers_it_names(
    tmp_path: Path, backends: list[str], not_imported: set[str]
) -> None:
    check = (
        "import sys\n"
        "from trinity_dagster.config import config_from_dict\n"
        "from trinity_dagster.monitor import open_monitor\n"
        f"config = config_from_dict({{'run_root': {str(tmp_path)!r}, "
        f"'monitor': {{'backends': {backends!r}}}}})\n"
        "monitor = open_monitor(config)\n"
        "monitor.log(1, {'actor/pg_loss': 0.5})\n"
        "monitor.close()\n"
        "print(sorted(sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not_imported.isdisjoint(done.stdout.split("'")), done.stdout


def test_a_backend_that_fails_to_start_fails_the_run_before_the_engine_starts(
    tmp_path: Path,
) -> None:
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    config = monitored_config(
        tmp_path, ALL_BACKENDS, total_steps=1, mlflow_tracking_uri=f"sqlite:///{not_a_dir}/m.db"
    )
    engine = FakeEngine()

    with pytest.raises(MonitorError, match=r"monitor backend 'mlflow' .* failed to start"):
        asyncio.run(Trainer(config, engine=engine).run())

    assert engine.prepared == 0 and engine.closed == 1


def test_a_failed_training_ends_its_mlflow_run_failed(tmp_path: Path, fake_vocab: None) -> None:
    config = monitored_config(tmp_path, ["mlflow"], total_steps=3)
    fill_buffer(config, 3)
    engine = FakeEngine(health_problems={2: ["actor/grad_norm is nan"]})

    with pytest.raises(SyncWithheldError):
        asyncio.run(Trainer(config, engine=engine).run())

    client, run = mlflow_run(config)
    assert run.info.status == "FAILED"
    assert sorted(mlflow_steps(client, run)) == [1]


class Failing(Monitor):
    def __init__(self) -> None:
        self.closed = False

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        raise OSError("disk full")

    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        raise AssertionError("not called here")

    def log_final_model(self, hf_dir: Path) -> None:
        raise AssertionError("not called here")

    def close(self) -> None:
        self.closed = True
        raise OSError("disk still full")


def test_a_failing_backend_is_named_and_the_others_are_still_closed() -> None:
    first, second = Failing(), Failing()
    group = MonitorGroup({"first": first, "second": second})

    with pytest.raises(MonitorError, match=r"'first' .* log the metrics of step 4: OSError: disk"):
        group.log(4, {"actor/pg_loss": 0.5})
    with pytest.raises(MonitorError, match="failed to close"):
        group.close()
    assert first.closed and second.closed


class FailingMetrics(Failing):
    """Takes the rollout preview, fails at the metrics."""

    def log_table(self, name: str, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        pass


def test_a_backend_failing_during_training_fails_the_loop_naming_it(tmp_path: Path) -> None:
    """The metrics are logged beside the loop; a failure still ends training with its cause."""
    config = monitored_config(tmp_path, [], total_steps=3)
    fill_buffer(config, 3)
    trainer = Trainer(config, engine=FakeEngine())
    asyncio.run(trainer.prepare())
    trainer.monitor = MonitorGroup({"first": FailingMetrics()})

    with pytest.raises(RuntimeError, match=r"tracking backends failed: .*'first'.*disk full"):
        asyncio.run(trainer.train())
    with pytest.raises(MonitorError, match="failed to close"):
        asyncio.run(trainer.shutdown())
    state = read_trainer_state(RunPaths.of(config.run_root))
    assert state is not None and state.state == "failed" and "disk full" in state.reason


def test_a_real_run_logs_every_step_and_the_final_model(tmp_path: Path) -> None:
    """The engine service trains 3 steps; the backends hold its metrics and final model."""
    config = monitored_config(tmp_path, ALL_BACKENDS, total_steps=3)
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 3)
    hook = RecordingHook()
    try:
        asyncio.run(Trainer(config, hook=hook).run())
    finally:
        stop_service(paths)

    expected = hook_steps(hook)
    pg_losses = {step: metrics["actor/pg_loss"] for step, metrics in expected.items()}
    assert list(pg_losses) == [1, 2, 3]
    tensorboard = tensorboard_steps(paths.root)
    assert {s: m["actor/pg_loss"] for s, m in tensorboard.items()} == pytest.approx(pg_losses)
    client, run = mlflow_run(config)
    assert mlflow_steps(client, run) == expected
    assert_config_params(run, config)
    assert run.info.status == "FINISHED"
    assert [line["step"] for line in jsonl_lines(paths.root)] == [1, 2, 3]
    # the final checkpoint's HF export, file for file, as the run's artifact `model`
    exported = checkpoint_dir(paths, 3) / HF_SUBDIR
    logged = Path(client.download_artifacts(run.info.run_id, "model", str(tmp_path / "dl")))
    names = sorted(p.name for p in exported.iterdir())
    assert "model.safetensors" in names and sorted(p.name for p in logged.iterdir()) == names
    for name in names:
        assert (logged / name).read_bytes() == (exported / name).read_bytes(), name
    # and as the W&B run's model artifact, with each file's digest
    records = wandb_records(paths.root)
    (artifact,) = [
        r.artifact for r in records if r.HasField("artifact") and r.artifact.type == "model"
    ]
    assert artifact.name == "model"
    assert sorted(entry.path for entry in artifact.manifest.contents) == names
    assert wandb_steps(paths.root) == expected
