"""`Trainer`'s loop over a fake `TrainEngineWrapper` and real Delta batches, without Dagster.

The fake engine records what the loop asked of it (train, save, publish); the batches are
pinned by the real sampler from experiences written to a tiny run's Delta table. The
expected schedule of saves and syncs is computed here from Trinity-RFT's rules, independently
of the trainer code.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import trinity_dagster.testing as testing
from tests.support.trainer_loop import (
    Event,
    FakeEngine,
    PublishFailed,
    RecordingHook,
    loop_config,
    start_in_thread,
)
from trinity_dagster.buffer.sampler import PinResult
from trinity_dagster.handoff.end_of_data import mark_end_of_data
from trinity_dagster.handoff.sync_requests import is_answered, pending_requests, request_sync
from trinity_dagster.handoff.trainer_state import DATA_ENDED, read_trainer_state
from trinity_dagster.lineage.checkpoint_summary import read_summary
from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.records import write_record
from trinity_dagster.testing import fill_buffer
from trinity_dagster.trainer import SyncWithheldError, Trainer

pytestmark = pytest.mark.usefixtures("no_initial_model")


def expected_events(
    total_steps: int, save_interval: int, sync_interval: int, sft_warmup: int = 0
) -> list[Event]:
    """Trinity-RFT's schedule, sync_style fixed and sync_method checkpoint, all data there.

    After each step: a save every `save_interval` steps (none for 0), except that the final
    step gets the one final blocking save instead; the SFT warm-up's last step, when RL steps
    follow, is saved too. Every save is a weights version (it exports HF weights and serves
    as the sync, due or not); a step without a save publishes its weights at every
    `sync_interval`-th step.
    """
    events: list[Event] = []
    for step in range(1, total_steps + 1):
        events.append(("train", step))
        periodic = save_interval > 0 and step % save_interval == 0
        if step in (total_steps, sft_warmup) or periodic:
            events.append(("save", step, step == total_steps, True, True))
        elif step % sync_interval == 0:
            events.append(("publish", step))
    return events


def run_trainer(trainer: Trainer, last_step: int | None = None) -> str:
    return asyncio.run(trainer.run(last_step))


@pytest.mark.parametrize("save_hf", ["always", "last", "never"])
@pytest.mark.parametrize("sync_interval", [1, 2, 4])
@pytest.mark.parametrize("save_interval", [0, 1, 3, 4])
@pytest.mark.parametrize("total_steps", [1, 6])
def test_schedule_of_saves_and_syncs(
    tmp_path: Path, total_steps: int, save_interval: int, sync_interval: int, save_hf: str
) -> None:
    config = loop_config(
        tmp_path,
        total_steps=total_steps,
        save_interval=save_interval,
        sync_interval=sync_interval,
        save_hf_checkpoint=save_hf,
        read_timeout_s=5.0,
    )
    fill_buffer(config, total_steps)
    engine, hook = FakeEngine(), RecordingHook()
    trainer = Trainer(config, engine=engine, hook=hook)

    reason = run_trainer(trainer)

    expected = expected_events(total_steps, save_interval, sync_interval)
    assert engine.events == expected
    assert reason.startswith(f"trained all {total_steps} steps")
    steps = list(range(1, total_steps + 1))
    assert hook.batches == steps
    assert hook.steps == steps
    assert hook.syncs == [e[1] for e in expected if e[0] == "publish"]
    assert [r["step"] for r in hook.records] == steps
    assert all(
        m["actor/pg_loss"] == pytest.approx(0.1 * s)
        for s, m in zip(steps, hook.metrics, strict=True)
    )
    # exactly one blocking save, the last event, of the final step
    blocking = [e for e in engine.events if e[0] == "save" and e[2]]
    assert blocking == [engine.events[-1]] and blocking[0][1] == total_steps
    # the final save published the final weights, whatever the sync interval
    assert engine.last_sync_step == trainer.last_sync_step == total_steps
    # every step trained its own, disjoint batch of the buffer's size
    all_eids = [eid for s in steps for eid in engine.batches[s]]
    assert len(all_eids) == len(set(all_eids)) == total_steps * config.buffer.train_batch_size
    state = read_trainer_state(RunPaths.of(config.run_root))
    assert state is not None
    assert (state.state, state.step) == ("finished", total_steps)
    assert state.finished(total_steps)
    assert engine.prepared >= 1 and engine.closed == 1


class RecordingEngine(FakeEngine):
    """Writes each step's record as the engine service does, and notes at each save which
    lineage summaries were on disk."""

    def __init__(self, paths: RunPaths) -> None:
        super().__init__()
        self.paths = paths
        self.summaries_at_save: dict[int, dict[str, Any] | None] = {}

    def train_step(self, batch: PinResult, *, publish: bool = False) -> dict[str, Any]:
        record = super().train_step(batch, publish=publish)
        write_record(self.paths, record)
        return record

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.summaries_at_save[self.step] = read_summary(self.paths, self.step)
        return super().save_checkpoint(*args, **kwargs)


def test_each_checkpoint_is_saved_after_its_lineage_summary(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=5, save_interval=2, read_timeout_s=5.0)
    fill_buffer(config, 5)
    paths = RunPaths.of(config.run_root)
    engine = RecordingEngine(paths)

    run_trainer(Trainer(config, engine=engine, hook=RecordingHook()))

    rows = config.buffer.train_batch_size
    assert engine.summaries_at_save == {
        step: {
            "step": step,
            "by_weights_version": {0: step * rows},  # the buffer's rows are all of weights v0
            "gaps": [],
            "experiences_trained": step * rows,
            "staleness_max": step - 1,
        }
        for step in (2, 4, 5)
    }


@pytest.mark.parametrize("save_hf", ["always", "last", "never"])
@pytest.mark.parametrize("warmup", [2, 3, 6])
def test_the_sft_warmups_last_step_is_checkpointed(
    tmp_path: Path, warmup: int, save_hf: str
) -> None:
    """The SFT model is kept: its step is saved (with HF weights unless `never`) when RL
    steps follow it; a run that is all warm-up just takes the final save."""
    config = loop_config(
        tmp_path,
        total_steps=6,
        save_interval=4,
        sync_interval=2,
        save_hf_checkpoint=save_hf,
        read_timeout_s=5.0,
        sft_warmup_steps=warmup,
    )
    fill_buffer(config, 6)
    engine = FakeEngine()

    run_trainer(Trainer(config, engine=engine, hook=RecordingHook()))

    assert engine.events == expected_events(6, 4, 2, sft_warmup=warmup)
    saves = [e[1] for e in engine.events if e[0] == "save"]
    assert saves == sorted({warmup, 4, 6})


def test_expected_schedule_examples() -> None:
    """The independent schedule itself, on two hand-checked cases."""
    assert expected_events(4, 2, 1) == [
        ("train", 1),
        ("publish", 1),
        ("train", 2),
        ("save", 2, False, True, True),
        ("train", 3),
        ("publish", 3),
        ("train", 4),
        ("save", 4, True, True, True),
    ]
    assert expected_events(3, 0, 2) == [
        ("train", 1),
        ("train", 2),
        ("publish", 2),
        ("train", 3),
        ("save", 3, True, True, True),
    ]


def test_each_step_logs_trinitys_sample_and_sync_interval_metrics(tmp_path: Path) -> None:
    """`sample/task_count` and `sample/model_version/*` of the pinned rows (also of a batch
    an earlier run pinned), and `time/trainer_sync_interval` from the second sync on."""
    from trinity_dagster.buffer.reader import load_step_batch
    from trinity_dagster.buffer.writer import ExperienceWriter

    config = loop_config(tmp_path, total_steps=3, sync_interval=1, read_timeout_s=5.0)
    groups = 3 * config.buffer.train_batch_size // config.algorithm.repeat_times
    rows = testing.synthetic_rows(config, groups, seed=0)
    for row in rows:  # two groups per task, versions 0..2 across groups
        group = int(row["group_id"].rsplit("-", 1)[1])
        row["task_id"], row["model_version"] = f"t{group // 2}", group % 3
    assert ExperienceWriter(config).write(rows).quarantined == 0
    testing.pin_steps(config, range(1, 2))  # step 1 was pinned before this run
    hook = RecordingHook()

    run_trainer(Trainer(config, engine=FakeEngine(), hook=hook))

    for step, metrics in zip([1, 2, 3], hook.metrics, strict=True):
        pinned = load_step_batch(config, step)
        versions = pinned.column("model_version").to_pylist()
        assert metrics["sample/task_count"] == len(set(pinned.column("task_id").to_pylist()))
        assert metrics["sample/model_version/mean"] == pytest.approx(sum(versions) / len(versions))
        assert metrics["sample/model_version/max"] == max(versions)
        assert metrics["sample/model_version/min"] == min(versions)
    assert "time/trainer_sync_interval" not in hook.metrics[0]  # the first sync
    assert hook.metrics[1]["time/trainer_sync_interval"] > 0  # (step 3's: the final save)


class MemorySyncEngine(FakeEngine):
    """Syncs by `sync_method: memory`: versions go to shared memory, not to disk."""

    def upload_state_dict(self) -> dict[str, Any]:
        self._record(("upload", self.step))
        self.synced = self.step
        return {"version": self.step}


def test_the_final_weights_reach_disk_when_their_step_was_not_synced(tmp_path: Path) -> None:
    """total_steps 5 with sync_interval 2: step 5 is never a due sync, yet its weights are
    published on disk after the final save, so the evaluation after training scores them."""
    config = loop_config(tmp_path, total_steps=5, sync_interval=2, read_timeout_s=5.0)
    config.synchronizer.sync_method = "memory"
    fill_buffer(config, 5)
    engine = MemorySyncEngine()

    run_trainer(Trainer(config, engine=engine, hook=RecordingHook()))

    assert engine.of_kind("upload") == [("upload", 2), ("upload", 4)]
    assert engine.events[-2:] == [("save", 5, True, True, False), ("publish", 5)]


@pytest.mark.parametrize("save_hf", ["always", "last", "never"])
def test_end_of_data_stops_early_with_final_save(tmp_path: Path, save_hf: str) -> None:
    config = loop_config(
        tmp_path, total_steps=6, save_interval=4, sync_interval=2, save_hf_checkpoint=save_hf
    )
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 3)
    mark_end_of_data(paths, "explorer-0", "task set used up (buffer.total_epochs)")
    engine, hook = FakeEngine(), RecordingHook()

    reason = run_trainer(Trainer(config, engine=engine, hook=hook))

    assert reason.startswith(DATA_ENDED), reason
    assert "after step 3" in reason and "task set used up" in reason
    assert engine.of_kind("train") == [("train", 1), ("train", 2), ("train", 3)]
    assert hook.steps == [1, 2, 3]
    assert engine.of_kind("publish") == [("publish", 2)]
    saves = engine.of_kind("save")
    assert saves == [("save", 3, True, True, True)]  # the final weights are published
    assert engine.events[-1] == saves[-1]
    state = read_trainer_state(paths)
    assert state is not None
    assert (state.state, state.step) == ("finished", 3)
    assert state.reason == reason
    assert state.finished(6)


def test_without_total_steps_the_loop_trains_until_the_data_ends(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=None, save_interval=2, sync_interval=1)
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 5)
    mark_end_of_data(paths, "explorer-0", "task set used up (buffer.total_epochs)")
    engine, hook = FakeEngine(), RecordingHook()

    reason = run_trainer(Trainer(config, engine=engine, hook=hook))

    assert reason.startswith(f"{DATA_ENDED} after step 5"), reason
    assert hook.steps == [1, 2, 3, 4, 5]
    # saves every 2 steps, then the final blocking one; step 5 was synced before the data ended
    saves = engine.of_kind("save")
    expected = [(2, False, True, True), (4, False, True, True), (5, True, True, False)]
    assert saves == [("save", *e) for e in expected], saves
    assert engine.of_kind("publish")[-1] == ("publish", 5)
    state = read_trainer_state(paths)
    assert state is not None and state.finished(None) and state.step == 5


def test_end_of_data_at_a_save_step_blocks_once(tmp_path: Path) -> None:
    """Data ends right after a periodic save: the final blocking save is the only blocking one."""
    config = loop_config(tmp_path, total_steps=6, save_interval=2, sync_interval=1)
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 2)
    mark_end_of_data(paths, "explorer-0", "done")
    engine = FakeEngine()

    reason = run_trainer(Trainer(config, engine=engine))

    assert reason.startswith(DATA_ENDED)
    assert engine.of_kind("train") == [("train", 1), ("train", 2)]
    saves = engine.of_kind("save")
    assert [s for s in saves if s[2]] == [("save", 2, True, True, False)]
    assert saves[-1] == engine.events[-1]
    assert engine.last_sync_step == 2


def test_end_of_data_before_any_step(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=3)
    paths = RunPaths.of(config.run_root)
    mark_end_of_data(paths, "explorer-0", "no tasks")
    engine = FakeEngine()

    reason = run_trainer(Trainer(config, engine=engine))

    assert reason.startswith(DATA_ENDED) and "no tasks" in reason
    assert engine.events == []  # nothing trained: nothing to save
    state = read_trainer_state(paths)
    assert state is not None and (state.state, state.step) == ("finished", 0)


def test_read_timeout_stops_early(tmp_path: Path) -> None:
    config = loop_config(
        tmp_path, total_steps=5, save_interval=0, save_hf_checkpoint="never", read_timeout_s=0.5
    )
    fill_buffer(config, 2)
    engine = FakeEngine()

    started = time.monotonic()
    reason = run_trainer(Trainer(config, engine=engine))
    elapsed = time.monotonic() - started

    assert reason.startswith(DATA_ENDED), reason
    assert "buffer.read_timeout_s" in reason
    assert 0.5 <= elapsed < 10
    assert engine.events == [
        ("train", 1),
        ("publish", 1),
        ("train", 2),
        ("publish", 2),
        ("save", 2, True, False, False),
    ]
    state = read_trainer_state(RunPaths.of(config.run_root))
    assert state is not None and (state.state, state.step) == ("finished", 2)


def test_last_step_stops_without_final_save_then_resumes(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=4, save_interval=0, sync_interval=2)
    fill_buffer(config, 4)
    engine = FakeEngine()

    reason = run_trainer(Trainer(config, engine=engine), last_step=2)
    assert reason.startswith("trained up to step 2")
    assert engine.events == [("train", 1), ("train", 2), ("publish", 2)]

    reason = run_trainer(Trainer(config, engine=engine))
    assert reason.startswith("trained all 4 steps")
    assert engine.events[3:] == [("train", 3), ("train", 4), ("save", 4, True, True, True)]


def test_explorer_request_synced_at_next_step_boundary(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=4, sync_style="explorer_driven", sync_interval=1)
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 4)
    engine = FakeEngine()
    written: list[Path] = []

    class AskAfterStep1(RecordingHook):
        def on_step(self, step: int, record: dict[str, Any], metrics: dict[str, Any]) -> None:
            super().on_step(step, record, metrics)
            if step == 1:  # step 1's boundary is over: the request is served at step 2's
                written.append(request_sync(paths, "e0", have_version=0))

    hook = AskAfterStep1()
    reason = run_trainer(Trainer(config, engine=engine, hook=hook))

    assert reason.startswith("trained all 4 steps")
    # without requests, explorer-driven never syncs; the one request gets step 2's weights
    assert engine.events == [
        ("train", 1),
        ("train", 2),
        ("publish", 2),
        ("train", 3),
        ("train", 4),
        ("save", 4, True, True, True),  # every save is a weights version
    ]
    assert hook.syncs == [2]
    assert is_answered(written[0])
    assert pending_requests(paths) == []


def test_explorer_request_at_final_step_is_served_by_final_save(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=2, sync_style="explorer_driven")
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 2)
    engine = FakeEngine()
    written: list[Path] = []

    class AskAtStep2(RecordingHook):
        def on_batch(self, step: int, batch: PinResult) -> None:
            super().on_batch(step, batch)
            if step == 2:
                written.append(request_sync(paths, "e0", have_version=0))

    run_trainer(Trainer(config, engine=engine, hook=AskAtStep2()))

    assert engine.events == [("train", 1), ("train", 2), ("save", 2, True, True, True)]
    assert engine.last_sync_step == 2
    assert is_answered(written[0])


def _wait_answered(path: Path, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not is_answered(path):
        assert time.monotonic() < deadline, f"request {path} not answered within {timeout} s"
        time.sleep(0.02)


def test_request_answered_while_trainer_waits_for_data(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=2, sync_style="explorer_driven")
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 1)
    engine, hook = FakeEngine(), RecordingHook()
    thread, outcome = start_in_thread(Trainer(config, engine=engine, hook=hook))
    try:
        hook.wait_for_step(1)
        time.sleep(0.2)  # the trainer is now waiting for step 2's batch
        assert thread.is_alive() and engine.of_kind("train") == [("train", 1)]

        # the explorer holds version 0 and asks: step 1's weights are synced while waiting
        _wait_answered(request_sync(paths, "e0", have_version=0))
        assert engine.of_kind("publish") == [("publish", 1)]
        assert hook.syncs == [1]

        # asking again with version 1: nothing newer, answered without another sync
        _wait_answered(request_sync(paths, "e0", have_version=1))
        assert engine.of_kind("publish") == [("publish", 1)]
        assert engine.of_kind("train") == [("train", 1)]

        fill_buffer(config, 1, seed=1)  # the explorer's next experiences arrive
        thread.join(30)
        assert not thread.is_alive()
    finally:
        mark_end_of_data(paths, "e0", "test over")  # never leave the thread waiting
        thread.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["reason"].startswith("trained all 2 steps")
    assert engine.events == [
        ("train", 1),
        ("publish", 1),
        ("train", 2),
        ("save", 2, True, True, True),
    ]
    assert pending_requests(paths) == []


def test_withheld_sync_fails_the_run(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=4, save_interval=0, sync_interval=2)
    fill_buffer(config, 4)
    engine = FakeEngine(health_problems={2: ["actor/grad_norm is nan"]})

    with pytest.raises(SyncWithheldError, match="weights of step 2 are withheld") as caught:
        run_trainer(Trainer(config, engine=engine))

    assert caught.value.step == 2
    assert caught.value.problems == ["actor/grad_norm is nan"]
    assert engine.events == [("train", 1), ("train", 2)]  # nothing published, step 3 not trained
    assert engine.publish_asked == [2]  # the train call was asked to, and withheld them
    assert engine.last_sync_step == 0
    state = read_trainer_state(RunPaths.of(config.run_root))
    assert state is not None
    assert (state.state, state.step) == ("failed", 2)
    assert state.reason.startswith("SyncWithheldError: weights of step 2")
    assert "actor/grad_norm is nan" in state.reason
    assert not state.finished(4)
    assert engine.closed == 1


def test_a_sync_due_at_a_step_is_made_by_its_train_call(tmp_path: Path) -> None:
    """One engine call trains the step and publishes it when the sync is due whatever
    explorers ask, and no save (which serves as the sync) is due; the hook still hears of it."""
    config = loop_config(tmp_path, total_steps=6, save_interval=3, sync_interval=2)
    fill_buffer(config, 6)
    engine, hook = FakeEngine(), RecordingHook()

    run_trainer(Trainer(config, engine=engine, hook=hook))

    assert engine.publish_asked == [2, 4]  # 3 and 6 save; 1 and 5 are not sync steps
    assert engine.events == expected_events(6, 3, 2)
    assert hook.syncs == [2, 4]
    timed = {s: m for s, m in zip(hook.steps, hook.metrics, strict=True)}
    assert all("time/sync_weight" in timed[s] for s in (2, 4))
    assert "time/trainer_sync_interval" in timed[4]


def test_explorer_driven_syncs_are_not_made_by_the_train_call(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=3, sync_style="explorer_driven")
    fill_buffer(config, 3)
    engine = FakeEngine()

    run_trainer(Trainer(config, engine=engine))

    assert engine.publish_asked == []


def test_withheld_sync_by_a_save_serving_as_sync(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=4, save_interval=2, sync_interval=2)
    fill_buffer(config, 4)
    engine = FakeEngine(health_problems={2: ["loss is inf"]})

    with pytest.raises(SyncWithheldError, match="step 2"):
        run_trainer(Trainer(config, engine=engine))

    # the checkpoint is written and kept, but it does not serve as the sync
    assert engine.events == [("train", 1), ("train", 2), ("save", 2, False, False, False)]
    state = read_trainer_state(RunPaths.of(config.run_root))
    assert state is not None and state.state == "failed" and "loss is inf" in state.reason


def test_the_final_checkpoint_is_kept_when_its_weights_are_withheld(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=2, save_interval=0, sync_interval=1)
    fill_buffer(config, 2)
    engine = FakeEngine(health_problems={2: ["actor/ppo_kl=9 outside [-1, 1]"]})

    with pytest.raises(SyncWithheldError, match="step 2"):
        run_trainer(Trainer(config, engine=engine))

    assert engine.of_kind("save") == [("save", 2, True, True, False)], "kept, not published"
    assert engine.of_kind("publish") == [("publish", 1)]


def test_health_problems_off_sync_steps_do_not_stop_training(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=4, save_interval=0, sync_interval=2)
    fill_buffer(config, 4)
    engine = FakeEngine(health_problems={1: ["kl out of bound"], 3: ["kl out of bound"]})

    reason = run_trainer(Trainer(config, engine=engine))

    assert reason.startswith("trained all 4 steps")
    assert engine.of_kind("publish") == [("publish", 2)]


def test_retry_after_error_following_the_weights_update(tmp_path: Path) -> None:
    config = loop_config(tmp_path, total_steps=4, save_interval=0, sync_interval=1)
    paths = RunPaths.of(config.run_root)
    fill_buffer(config, 4)
    engine = FakeEngine(fail_publish_at=2)

    with pytest.raises(PublishFailed):
        run_trainer(Trainer(config, engine=engine))
    # step 2's weights were updated in the engine, but not published
    assert engine.events == [("train", 1), ("publish", 1), ("train", 2), ("publish failed", 2)]
    assert (engine.train_step_num, engine.last_sync_step) == (2, 1)
    state = read_trainer_state(paths)
    assert state is not None and (state.state, state.step) == ("failed", 2)
    assert "PublishFailed" in state.reason

    hook = RecordingHook()
    retry = Trainer(config, engine=engine, hook=hook)
    reason = run_trainer(retry)

    assert reason.startswith("trained all 4 steps")
    # step 2's owed sync comes first, before step 3 is trained
    assert engine.events[4:] == [
        ("publish", 2),
        ("train", 3),
        ("publish", 3),
        ("train", 4),
        ("save", 4, True, True, True),
    ]
    assert hook.syncs == [2, 3]
    assert hook.steps == [3, 4]
    assert engine.of_kind("train") == [("train", s) for s in (1, 2, 3, 4)]
    state = read_trainer_state(paths)
    assert state is not None and (state.state, state.step) == ("finished", 4)


def test_retry_of_a_run_that_trained_the_final_step(tmp_path: Path) -> None:
    """A run killed after training the last step: the retry makes only the final save."""
    config = loop_config(tmp_path, total_steps=2, save_interval=0, sync_interval=1)
    fill_buffer(config, 2)
    engine = FakeEngine(step=2, last_sync_step=1)

    reason = run_trainer(Trainer(config, engine=engine))

    assert reason.startswith("trained all 2 steps")
    assert engine.events == [("save", 2, True, True, True)]
    assert engine.last_sync_step == 2
