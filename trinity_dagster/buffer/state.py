"""The sampler cursor: plain JSON state a checkpoint manifest can hold and restore."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class SamplerStateError(ValueError):
    """A sampler state (JSON) is malformed; the message names the key."""


@dataclass(frozen=True)
class SamplerState:
    """What was consumed after pinning `step`.

    Every experience with `ingest_seq < watermark` is resolved (trained on as often as its
    strategy allows, or dropped). Above the watermark, `done` lists resolved eids and `uses`
    counts the uses of eids that may still be sampled again (priority with reuse_limit > 1).
    """

    step: int = 0
    watermark: int = 0
    source_version: int = -1
    done: tuple[str, ...] = ()
    uses: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        """Compact JSON text."""
        return json.dumps(
            {
                "step": self.step,
                "watermark": self.watermark,
                "source_version": self.source_version,
                "done": list(self.done),
                "uses": self.uses,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for a checkpoint manifest)."""
        return json.loads(self.to_json())

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> SamplerState:
        """Parse JSON text or a dict produced by `to_json`/`to_dict`."""
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except ValueError as err:
                raise SamplerStateError(f"sampler state: invalid JSON ({err})") from None
        if not isinstance(data, dict):
            raise SamplerStateError("sampler state: expected a JSON object")
        for key in ("step", "watermark", "source_version"):
            if not isinstance(data.get(key), int):
                raise SamplerStateError(f"sampler state: '{key}' must be an integer")
        done = data.get("done", [])
        uses = data.get("uses", {})
        if not isinstance(done, list) or not all(isinstance(e, str) for e in done):
            raise SamplerStateError("sampler state: 'done' must be a list of eids")
        if not isinstance(uses, dict) or not all(isinstance(v, int) for v in uses.values()):
            raise SamplerStateError("sampler state: 'uses' must map eids to integers")
        return cls(
            step=data["step"],
            watermark=data["watermark"],
            source_version=data["source_version"],
            done=tuple(done),
            uses=dict(uses),
        )
