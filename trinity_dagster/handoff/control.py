"""Control requests from Dagster runs to the running trainer loop: save, sync, pause, stop.

The long-lived trainer run owns the engine, so work a user asks for during training goes to
its loop instead of to a second engine client. A run that asks writes
`control/requests/<request_id>.json`; the trainer loop reads the requests at each step
boundary and while it waits for data, claims each one it can serve now by deleting its file
(so two servers never serve one request), does the work and writes
`control/answers/<request_id>.json` with the outcome. The asking run waits for the answer; if
no trainer loop is alive it claims its request back and serves it itself.

The pause mark (`control/paused.json`) is separate from the requests: it says that the user
paused training, so nothing starts the trainer loop again until the user resumes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

from trinity_dagster.files import write_text_atomic
from trinity_dagster.paths import RunPaths

Action = Literal["save", "sync", "pause", "stop"]
ACTIONS: tuple[Action, ...] = get_args(Action)
ANSWER_POLL_S = 0.2
# how long an ended loop may take from its final state to its answer: the due save and sync
# requests of its last step are served in between
CLAIMED_GRACE_S = 60.0


@dataclass(frozen=True)
class ControlRequest:
    """Run `request_id` asks the trainer loop to `action` (at `step`, for save and sync)."""

    request_id: str
    action: Action
    step: int | None = None
    hf: bool = False
    requested_at: float = 0.0

    def describe(self) -> str:
        """The request in a few words, for messages."""
        at = f" of step {self.step}" if self.step is not None else ""
        return f"{self.action}{at} (request {self.request_id})"


def _requests_dir(paths: RunPaths) -> Path:
    return paths.control_requests


def _answers_dir(paths: RunPaths) -> Path:
    return paths.control_answers


def _file(folder: Path, request_id: str) -> Path:
    if not request_id or "/" in request_id or request_id.startswith("."):
        raise ValueError(f"invalid control request id {request_id!r}")
    return folder / f"{request_id}.json"


def submit_request(
    paths: RunPaths, request_id: str, action: Action, *, step: int | None = None, hf: bool = False
) -> ControlRequest:
    """Ask the trainer loop for `action`; returns the request as written."""
    if action not in ACTIONS:
        raise ValueError(f"unknown control action {action!r}; known: {', '.join(ACTIONS)}")
    if action in ("save", "sync") and (step is None or step < 1):
        raise ValueError(f"a {action} request needs a step >= 1, got {step}")
    request = ControlRequest(request_id, action, step, hf, time.time())
    _file(_answers_dir(paths), request_id).unlink(missing_ok=True)
    write_text_atomic(_file(_requests_dir(paths), request_id), json.dumps(asdict(request)))
    return request


def pending_requests(paths: RunPaths) -> list[ControlRequest]:
    """The requests nobody claimed yet, oldest first."""
    folder = _requests_dir(paths)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.glob("*.json"):
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            continue  # claimed meanwhile
        data["action"] = cast(Action, data["action"])
        found.append(ControlRequest(**data))
    return sorted(found, key=lambda r: (r.requested_at, r.request_id))


def claim(paths: RunPaths, request: ControlRequest) -> bool:
    """Take `request` to serve it; False if another server took it first."""
    try:
        os.unlink(_file(_requests_dir(paths), request.request_id))
    except FileNotFoundError:
        return False
    return True


def answer(
    paths: RunPaths, request: ControlRequest, *, ok: bool, message: str, **result: Any
) -> None:
    """Record the outcome of a claimed request for the run that asked."""
    body = {"ok": ok, "message": message, "action": request.action, "step": request.step, **result}
    write_text_atomic(_file(_answers_dir(paths), request.request_id), json.dumps(body))


def read_answer(paths: RunPaths, request_id: str) -> dict[str, Any] | None:
    """The answer to request `request_id`, or None while it has none."""
    try:
        return json.loads(_file(_answers_dir(paths), request_id).read_text())
    except FileNotFoundError:
        return None


def forget(paths: RunPaths, request_id: str) -> None:
    """Remove request `request_id` and its answer (the asking run is done with them)."""
    for folder in (_requests_dir(paths), _answers_dir(paths)):
        _file(folder, request_id).unlink(missing_ok=True)


def open_save_steps(paths: RunPaths) -> dict[int, list[str]]:
    """Steps whose checkpoint a run asked for and has not recorded yet: step -> request ids."""
    steps: dict[int, list[str]] = {}
    for request in pending_requests(paths):
        if request.action == "save" and request.step is not None:
            steps.setdefault(request.step, []).append(request.request_id)
    folder = _answers_dir(paths)
    for path in folder.glob("*.json") if folder.is_dir() else ():
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            data = json.loads(path.read_text())
            if data.get("action") == "save" and data.get("ok"):
                steps.setdefault(int(data["step"]), []).append(path.stem)
    return steps


def wait_for_answer(
    paths: RunPaths,
    request: ControlRequest,
    *,
    loop_alive: Callable[[], bool],
    timeout_s: float,
    claimed_grace_s: float = CLAIMED_GRACE_S,
) -> dict[str, Any] | None:
    """The loop's answer to `request`; None if no loop is alive to give one (the caller then
    serves the request itself). Raises TimeoutError after `timeout_s`.

    A loop that claimed the request answers it as it ends, after it has written its final
    state: so when no loop is alive but the request is claimed, the answer is awaited for
    `claimed_grace_s` more; a loop that died before answering leaves it to the caller."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = read_answer(paths, request.request_id)
        if found is not None:
            return found
        if not loop_alive():
            if claim(paths, request):
                return None  # taken back: nobody serves it but the caller
            return _claimed_answer(paths, request, claimed_grace_s)
        if time.monotonic() > deadline:
            forget(paths, request.request_id)
            raise TimeoutError(
                f"the trainer loop did not answer {request.describe()} within {timeout_s:.0f} s"
            )
        time.sleep(ANSWER_POLL_S)


def _claimed_answer(
    paths: RunPaths, request: ControlRequest, grace_s: float
) -> dict[str, Any] | None:
    """The answer of the loop that claimed `request`, awaited `grace_s` at most."""
    deadline = time.monotonic() + grace_s
    while (found := read_answer(paths, request.request_id)) is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(ANSWER_POLL_S)
    return found


def _pause_file(paths: RunPaths) -> Path:
    return paths.pause_mark


def set_paused(paths: RunPaths, by: str) -> None:
    """Mark training as paused by the user (run `by`): the trainer loop is not restarted."""
    write_text_atomic(_pause_file(paths), json.dumps({"by": by, "at": time.time()}))


def clear_paused(paths: RunPaths) -> bool:
    """Remove the pause mark; returns whether there was one."""
    try:
        _pause_file(paths).unlink()
    except FileNotFoundError:
        return False
    return True


def paused_by(paths: RunPaths) -> str | None:
    """The run that paused training, or None when it is not paused."""
    try:
        return str(json.loads(_pause_file(paths).read_text())["by"])
    except FileNotFoundError:
        return None
