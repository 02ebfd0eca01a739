"""Delta table locations: `buffer.tables_root` takes a directory or a `file://` URI.

Nothing in the buffer assumes a local path: Delta Lake gets the location as written, and the
two file system touches (creating the parent directory, a `stat` of the log) go through
`trinity_dagster.paths.local_path`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deltalake import DeltaTable

from tests.buffer_support import make_config, make_rows
from trinity_dagster.buffer import ExperienceWriter, PinResult, pin_batch
from trinity_dagster.buffer.maintenance import compact
from trinity_dagster.buffer.reader import load_step_batch
from trinity_dagster.buffer.stats import table_stats
from trinity_dagster.buffer.tables import has_commit_after
from trinity_dagster.config import ConfigError, load_config
from trinity_dagster.paths import RunPaths, join_location, local_path, uri_scheme


def test_experiences_are_written_pinned_and_read_through_a_file_uri(tmp_path: Path) -> None:
    tables = tmp_path / "shared" / "tables"
    uri = tables.as_uri()
    assert uri.startswith("file:///")
    config = make_config(tmp_path / "run", tables_root=uri)
    paths = RunPaths.of_config(config)
    assert paths.experiences == f"{uri}/experiences"

    bad = {**make_rows("bad", 1)[0], "reward": float("nan")}
    report = ExperienceWriter(config).write([*make_rows("a", 4), bad])
    assert (report.written, report.quarantined) == (4, 1)
    # the writer created the table (commit 0) and appended once (commit 1)
    assert has_commit_after(paths.experiences, None)
    assert has_commit_after(paths.experiences, 0)
    assert not has_commit_after(paths.experiences, 1)
    pinned = pin_batch(config, 1)
    assert isinstance(pinned, PinResult) and len(pinned.eids) == 4
    assert sorted(load_step_batch(config, 1).column("eid").to_pylist()) == sorted(pinned.eids)
    stats = table_stats(config)
    assert stats["row_count"] == 4 and stats["quarantined"] == 1
    assert stats["last_pinned_step"] == 1 and stats["unconsumed"] == 0
    assert set(compact(config)) == {"experiences", "batches", "quarantine"}

    # The tables are where the URI says, and none went under the run root.
    assert {p.name for p in tables.iterdir()} == {"experiences", "batches", "quarantine"}
    assert DeltaTable(str(tables / "experiences")).to_pyarrow_table().num_rows == 4
    assert not (tmp_path / "run" / "experiences").exists()


def test_a_relative_tables_root_resolves_against_the_config_file(tmp_path: Path) -> None:
    file = tmp_path / "conf" / "run.yaml"
    file.parent.mkdir()
    file.write_text("buffer:\n  tables_root: ../tables\n")
    config = load_config(file)
    assert config.buffer.tables_root == str(tmp_path / "tables")
    assert RunPaths.of_config(config).batches == str(tmp_path / "tables" / "batches")
    unset = load_config(None, overrides={"run_root": str(tmp_path / "r")})
    assert RunPaths.of_config(unset).experiences == str(tmp_path / "r" / "experiences")


def test_where_the_tables_live_does_not_change_the_config_hash(tmp_path: Path) -> None:
    plain = load_config(None)
    moved = load_config(None, overrides={"buffer.tables_root": (tmp_path / "t").as_uri()})
    assert plain.resolved_hash() == moved.resolved_hash()


@pytest.mark.parametrize("root", ["s3://bucket/tables", "file://otherhost/tables"])
def test_tables_off_the_file_system_are_refused_naming_the_key(root: str) -> None:
    with pytest.raises(ConfigError, match=r"buffer\.tables_root: .*only a directory or a file://"):
        load_config(None, overrides={"buffer.tables_root": root})


def test_locations_join_and_map_to_local_paths() -> None:
    assert uri_scheme("file:///data/t") == "file" and uri_scheme("/data/t") is None
    assert uri_scheme("relative/dir") is None
    assert local_path("file:///data/my%20tables") == Path("/data/my tables")
    assert local_path("file://localhost/data/t") == Path("/data/t")
    assert local_path("/data/t") == Path("/data/t")
    with pytest.raises(ValueError, match="not on the local file system"):
        local_path("s3://bucket/t")
    assert join_location("file:///data/", "batches") == "file:///data/batches"
    assert join_location("/data", "batches") == "/data/batches"
    assert join_location(Path("/data"), "batches") == "/data/batches"
