"""Steering a running training from the UI: pause, resume and stop jobs, and the hand-off
of save and sync requests to the trainer loop.

The long-lived trainer run owns the engine, so a run the user launches during training does
not take the `engine` pool: it writes a control request (`trinity_dagster.handoff.control`)
and waits for the loop's answer, which comes at the loop's next step boundary or at once
while it waits for data. With no trainer loop alive (paused, finished, between runs) the run
serves itself. Jobs (Launchpad of each job in the UI, or `dagster job launch`):
- `pause_training`: the loop ends after the current step and its due saves, the engine
  stays at that step, the trainer state says `paused`, and `rft_loop_sensor` starts no
  trainer run until `resume_training`;
- `resume_training`: clears the pause; the sensor's next tick starts the trainer run from
  the engine's step;
- `stop_training`: ends training now with the final blocking save and HF export, as a
  normal end; step partitions after it that nothing materialised are removed.
"""

from typing import Any

import dagster as dg

from assets.partitions import STEP_PARTITIONS, step_of
from resources.engine import EngineResource
from resources.run_config import RunConfigResource
from trinity_dagster.graph_names import ROLLOUTS, TRAIN
from trinity_dagster.handoff import control
from trinity_dagster.handoff.control import Action
from trinity_dagster.handoff.trainer_state import (
    STOPPED,
    TrainerState,
    read_trainer_state,
    write_trainer_state,
)
from trinity_dagster.paths import RunPaths

# what an asset's or op's body gets: both know their run
RunContext = dg.AssetExecutionContext | dg.OpExecutionContext


def request_id(context: RunContext, action: Action, step: int | None) -> str:
    """The id of this run's request (the run id first, so the sensor can find the run)."""
    return f"{context.run_id}.{action}.{step if step is not None else 'now'}"


def run_of_request(request_id: str) -> str:
    """The Dagster run that made request `request_id`."""
    return request_id.split(".", 1)[0]


def loop_alive(run_config: RunConfigResource) -> bool:
    """Whether a trainer loop is running now."""
    state = read_trainer_state(run_config.paths)
    return state is not None and state.loop_alive()


def ask_trainer(
    context: RunContext,
    run_config: RunConfigResource,
    action: Action,
    *,
    step: int | None = None,
    hf: bool = False,
) -> dict[str, Any] | None:
    """The trainer loop's answer to this run's request; None when no loop is alive to serve
    it (the caller then serves it itself). A refusal fails the run with the loop's reason."""
    paths = run_config.paths
    request = control.submit_request(
        paths, request_id(context, action, step), action, step=step, hf=hf
    )
    context.log.info(f"asked the trainer loop: {request.describe()}")
    try:
        found = control.wait_for_answer(
            paths,
            request,
            loop_alive=lambda: loop_alive(run_config),
            timeout_s=run_config.config.service.request_timeout_s,
        )
    except TimeoutError as err:
        raise dg.Failure(str(err)) from err
    if found is None:
        context.log.info("no trainer loop is running: this run serves the request itself")
        return None
    if not found["ok"]:
        control.forget(paths, request.request_id)
        raise dg.Failure(f"the trainer loop refused {request.describe()}: {found['message']}")
    context.log.info(f"the trainer loop answered: {found['message']}")
    return found


def fail_if_finished(paths: RunPaths) -> TrainerState | None:
    """The trainer state; fails the run (and clears a pause mark) if training has finished."""
    state = read_trainer_state(paths)
    if state is not None and state.state == "finished":
        control.clear_paused(paths)
        raise dg.Failure(f"training already finished at step {state.step}: {state.reason}")
    return state


@dg.op(description="Pause training after the current step and its due saves.")
def pause(context: dg.OpExecutionContext, run_config: RunConfigResource) -> None:
    """Mark training paused and have the running loop end after its current step."""
    paths = run_config.paths
    fail_if_finished(paths)
    control.set_paused(paths, by=context.run_id)
    found = ask_trainer(context, run_config, "pause")
    if found is None:
        state = fail_if_finished(paths)  # as the last loop left it
        step = state.step if state is not None else 0
        write_trainer_state(paths, "paused", step, f"paused by run {context.run_id}")
    else:
        step = int(found["step"])
    control.forget(paths, request_id(context, "pause", None))
    context.log.info(
        f"training is paused at step {step}; launch resume_training to go on from there"
    )


@dg.op(description="Resume a paused training from the engine's step.")
def resume(context: dg.OpExecutionContext, run_config: RunConfigResource) -> None:
    """Clear the pause mark; `rft_loop_sensor` starts the trainer run at its next tick."""
    paths = run_config.paths
    if not control.clear_paused(paths):
        raise dg.Failure("training is not paused: there is nothing to resume")
    state = read_trainer_state(paths)
    at = state.step if state is not None else 0
    context.log.info(
        f"resumed: rft_loop_sensor starts the trainer run from step {at + 1} at its next tick "
        "(turn the sensor on if it is off)"
    )


@dg.op(description="Stop training now with the final blocking save, as a normal end.")
def stop(
    context: dg.OpExecutionContext, run_config: RunConfigResource, engine: EngineResource
) -> None:
    """End training at the current step with the final save; forget untrained partitions."""
    paths = run_config.paths
    fail_if_finished(paths)
    found = ask_trainer(context, run_config, "stop")
    if found is None:
        from trinity_dagster.trainer import Trainer  # its data libraries: in the run worker only

        trainer = Trainer(run_config.config, engine.wrapper())  # closed with the resource
        trainer.engine.prepare()
        trainer.last_sync_step = trainer.engine.last_sync_step
        step = trainer.train_step_num
        trainer.finish(f"{STOPPED} {request_id(context, 'stop', None)} at step {step}")
    else:
        step = int(found["step"])
    control.forget(paths, request_id(context, "stop", None))
    control.clear_paused(paths)  # finished now: nothing to resume
    dropped = drop_untouched_partitions(context.instance, after=step)
    context.log.info(
        f"training stopped at step {step} with its final checkpoint"
        + (f"; removed {len(dropped)} step partitions nothing materialised" if dropped else "")
    )


def drop_untouched_partitions(instance: dg.DagsterInstance, after: int) -> list[str]:
    """Delete the step partitions after step `after` that no train step or rollout recorded."""
    used = instance.get_materialized_partitions(dg.AssetKey(TRAIN)) | (
        instance.get_materialized_partitions(dg.AssetKey(ROLLOUTS))
    )
    keys = instance.get_dynamic_partitions(STEP_PARTITIONS)
    dropped = [key for key in keys if step_of(key) > after and key not in used]
    for key in dropped:
        instance.delete_dynamic_partition(STEP_PARTITIONS, key)
    return dropped


@dg.job(description="Pause: the trainer loop ends after its current step; nothing restarts it.")
def pause_training() -> None:
    """The pause action of the UI (Launchpad of this job)."""
    pause()


@dg.job(description="Resume a paused training: the sensor starts the trainer run again.")
def resume_training() -> None:
    """The resume action of the UI."""
    resume()


@dg.job(description="Stop: end training now with the final blocking save and HF export.")
def stop_training() -> None:
    """The stop action of the UI."""
    stop()
