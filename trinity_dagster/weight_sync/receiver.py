"""An explorer's side of collective weight sync: one version into its loaded model, in place.

`receive_weights` asks the engine service for a transfer of version N, joins the transfer's
two-rank group and receives bucket by bucket. A bucket that carries one tensor of the
model's dtype and size is received straight into that tensor's memory; others go through one
scratch bucket and are copied (and cast) into the model. Every bucket's checksum is checked
against the sender's; a mismatch, a missing or unknown tensor, or a lost sender raises
`WeightSyncError`, and the model must then be thrown away (part of it may hold the new
version). The sender learns the verdict through the store.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from trinity_dagster.paths import RunPaths
from trinity_dagster.service_api.state import read_state, read_token
from trinity_dagster.weight_sync.buckets import Layout, TensorSlot, checksum, tensor_view
from trinity_dagster.weight_sync.errors import WeightSyncError
from trinity_dagster.weight_sync.group import (
    join_store,
    local_address_towards,
    pair_group,
    transfer_device,
)
from trinity_dagster.weight_sync.sender import OK, RESULT_KEY

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Received:
    """What one transfer delivered."""

    version: int
    nbytes: int
    seconds: float
    direct_buckets: int  # received straight into the model's memory


def request_transfer(paths: RunPaths, version: int, receiver: str) -> dict[str, Any]:
    """Ask the run's engine service for a transfer of `version` (raises if it cannot)."""
    state = read_state(paths)
    if state is None:
        raise WeightSyncError(
            f"no engine service runs for {paths.root}: weights version {version} cannot be "
            "received over the collective"
        )
    from trinity_dagster.service_api.client import (  # httpx: not needed to receive
        EngineClient,
        EngineError,
        EngineTimeout,
        EngineUnreachable,
    )

    try:
        with EngineClient(state.url, read_token(paths)) as client:
            return client.weights_transfer(version, receiver)
    except (EngineError, EngineUnreachable, EngineTimeout) as err:
        raise WeightSyncError(
            f"the engine service could not start a transfer of weights version {version}: {err}"
        ) from err


def receive_weights(
    paths: RunPaths, version: int, targets: Mapping[str, torch.Tensor], receiver: str
) -> Received:
    """Receive weights `version` into `targets` (HF name -> tensor, e.g. a model's
    `state_dict()`, whose tensors share the parameters' memory)."""
    return receive_described(request_transfer(paths, version, receiver), targets)


def receive_described(transfer: Mapping[str, Any], targets: Mapping[str, torch.Tensor]) -> Received:
    """Receive the transfer `transfer` (the sender's answer) into `targets`."""
    started = time.perf_counter()
    layout = Layout.from_json(transfer["layout"])
    host, port, prefix = transfer["address"], int(transfer["port"]), transfer["prefix"]
    timeout_s = float(transfer["timeout_s"])
    try:
        store: Any = join_store(host, port, timeout_s)
    except (OSError, RuntimeError) as err:  # the service died since it answered
        raise WeightSyncError(
            f"weights version {transfer['version']}: the engine service's store at "
            f"{host}:{port} is unreachable: {err}"
        ) from err
    verdict = "receiver failed before the end"
    group = None
    try:
        _check_names(layout, targets)
        group = pair_group(
            store, prefix, 1, transfer["backend"], local_address_towards(host, port), timeout_s
        )
        device = transfer_device(transfer["backend"])
        direct = _receive_all(group, int(transfer["version"]), layout, targets, device)
        verdict = OK
    except WeightSyncError as err:
        verdict = str(err)
        raise
    except Exception as err:
        verdict = f"{type(err).__name__}: {err}"
        raise WeightSyncError(
            f"weights version {transfer['version']} from {host}:{port} failed: "
            f"{type(err).__name__}: {err}"
        ) from err
    finally:
        try:
            store.set(prefix + RESULT_KEY, verdict)
        except Exception:  # the sender is gone: nobody to tell
            log.debug("could not report the transfer's verdict", exc_info=True)
        handles: list[object] = [group, store]
        group = store = None  # the thread below holds the last references
        _release_in_background(handles)
    return Received(int(transfer["version"]), layout.nbytes, time.perf_counter() - started, direct)


def _release_in_background(handles: list[object]) -> None:
    """Drop the last references to a finished transfer's group and store (`handles`) in a
    thread of its own: closing a gloo group's connections takes ~20 ms the explorer need not
    wait for."""
    threading.Thread(target=handles.clear, daemon=True).start()


def _receive_all(
    group: Any,
    version: int,
    layout: Layout,
    targets: Mapping[str, torch.Tensor],
    device: torch.device,
) -> int:
    """Receive every bucket into `targets`; returns how many went straight into them."""
    direct = 0
    scratch: torch.Tensor | None = None
    damaged: str | None = None
    for index, (spec, slots) in enumerate(
        zip(layout.buckets, layout.slots_by_bucket(), strict=True)
    ):
        into = None if damaged else _direct_target(slots, spec.nbytes, targets, device)
        is_direct = into is not None
        if into is None:
            if scratch is None or scratch.numel() < spec.nbytes:
                scratch = torch.empty(spec.nbytes, dtype=torch.uint8, device=device)
            into = scratch[: spec.nbytes]
        group.broadcast(into, 0).wait()
        if damaged:
            continue  # drained, so that the sender finishes and reads the verdict
        got = checksum(into)
        if got != spec.checksum:
            damaged = (
                f"bucket {index} of weights version {version} (tensors "
                f"{', '.join(s.name for s in slots[:3])}{'...' if len(slots) > 3 else ''}) "
                f"arrived damaged: checksum {got:#018x}, the sender's {spec.checksum:#018x}; "
                "the explorer's model is discarded"
            )
        elif is_direct:
            direct += 1
        else:
            for slot in slots:
                targets[slot.name].copy_(tensor_view(into, slot))
    if damaged:
        raise WeightSyncError(damaged)
    return direct


def _direct_target(
    slots: list[TensorSlot],
    nbytes: int,
    targets: Mapping[str, torch.Tensor],
    device: torch.device,
) -> torch.Tensor | None:
    """The model tensor's own bytes, when the bucket is exactly that one tensor."""
    if len(slots) != 1:
        return None
    slot, target = slots[0], targets[slots[0].name]
    fits = (
        str(target.dtype).removeprefix("torch.") == slot.dtype
        and target.is_contiguous()
        and target.device == device
        and target.numel() * target.element_size() == slot.nbytes == nbytes
    )
    return target.detach().view(-1).view(torch.uint8) if fits else None


def _check_names(layout: Layout, targets: Mapping[str, torch.Tensor]) -> None:
    """Every sent tensor has a target of its shape, and every target is sent or tied to one
    that is."""
    sent = {slot.name: slot for slot in layout.tensors}
    unknown = sorted(set(sent) - set(targets))
    wrong = [
        f"{name} {list(sent[name].shape)} vs {list(targets[name].shape)}"
        for name in sent
        if name in targets and tuple(targets[name].shape) != sent[name].shape
    ]
    given = {targets[name].data_ptr() for name in sent if name in targets}
    missing = [n for n in targets if n not in sent and targets[n].data_ptr() not in given]
    if unknown or missing or wrong:
        raise WeightSyncError(
            f"the sent weights do not match the explorer's model: unknown {unknown or 'none'}, "
            f"missing {missing or 'none'}, other shapes {wrong or 'none'}"
        )
