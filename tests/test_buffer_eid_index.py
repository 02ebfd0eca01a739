"""The writer's index of stored eids: small, and exact together with the writer's check."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import trinity_dagster.buffer.eid_index as eid_index
from tests.support.buffer import buffer_config, make_row
from trinity_dagster.buffer.eid_index import EidIndex
from trinity_dagster.buffer.writer import ExperienceWriter


def eids(n: int, seed: int) -> list[str]:
    return [str(uuid.UUID(int=seed << 64 | i)) for i in range(n)]


def test_candidates_are_the_stored_eids_across_merges(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eid_index, "MERGE_AT", 1000)
    index = EidIndex()
    stored = eids(2500, seed=1)
    for start in range(0, 2500, 300):  # merges at 1000 and 2000, 500 still recent
        index.add(stored[start : start + 300])
    index.add(stored[:10])  # added twice: held once
    new = eids(500, seed=2)
    asked = stored[::7] + new
    assert index.candidates(asked) == stored[::7]  # no 64-bit collision among these
    assert len(index) == 2500 and index.nbytes == 2500 * 8


def test_an_index_takes_8_bytes_an_eid() -> None:
    index = EidIndex()
    for seed in range(20):
        index.add(eids(10_000, seed))
    assert len(index) == 200_000 and index.nbytes == 1_600_000


def test_a_new_eid_sharing_a_stored_ones_hash_is_still_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eid_index, "hash", lambda eid: 7, raising=False)  # every eid collides
    config = buffer_config(tmp_path)
    writer = ExperienceWriter(config)
    assert writer.write([make_row("a"), make_row("b")]).written == 2
    report = writer.write([make_row("c"), make_row("a")])
    assert (report.written, report.quarantined) == (1, 1)
    assert "'a' already in the experiences table" in report.reasons[0].reason
    fresh = ExperienceWriter(config)  # builds its index from the table
    report = fresh.write([make_row("b"), make_row("d")])
    assert (report.written, report.quarantined) == (1, 1)
    assert report.reasons[0].eid == "b"
