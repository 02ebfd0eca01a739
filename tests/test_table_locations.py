"""Delta table locations: `buffer.tables_root` takes a directory or a `file://` URI.

Nothing in the buffer assumes a local path: Delta Lake gets the location as written, and the
two file system touches (creating the parent directory, a `stat` of the log) go through
`trinity_dagster.paths.local_path`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deltalake import DeltaTable

from tests.support.buffer import buffer_config, make_rows
from trinity_dagster.buffer import ExperienceWriter, PinResult, pin_batch
from trinity_dagster.buffer.maintenance import compact
from trinity_dagster.buffer.reader import load_step_batch
from trinity_dagster.buffer.stats import table_stats
from trinity_dagster.buffer.tables import has_commit_after, open_or_create
from trinity_dagster.buffer.validation import INPUT_SCHEMA
from trinity_dagster.config import ConfigError, load_config
from trinity_dagster.paths import RunPaths, join_location, local_path, uri_scheme


def test_experiences_are_written_pinned_and_read_through_a_file_uri(tmp_path: Path) -> None:
    tables = tmp_path / "shared" / "tables"
    uri = tables.as_uri()
    assert uri.startswith("file:///")
    config = buffer_config(tmp_path / "run", tables_root=uri)
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


def _write_pin_read(config) -> None:
    """One write (4 good rows, 1 quarantined), a pin, a read, stats and a compaction."""
    bad = {**make_rows("bad", 1)[0], "reward": float("nan")}
    report = ExperienceWriter(config).write([*make_rows("a", 4), bad])
    assert (report.written, report.quarantined) == (4, 1)
    pinned = pin_batch(config, 1)
    assert isinstance(pinned, PinResult) and len(pinned.eids) == 4
    assert sorted(load_step_batch(config, 1).column("eid").to_pylist()) == sorted(pinned.eids)
    stats = table_stats(config)
    assert (stats["row_count"], stats["quarantined"], stats["unconsumed"]) == (4, 1, 0)
    assert set(compact(config)) == {"experiences", "batches", "quarantine"}


# Legal directory names Delta Lake addresses as they are: none of them may be decoded.
ADDRESSABLE_NAMES = {
    "space": "my runs",
    "hash": "run#3",
    "non-ascii": "läufe-日本-😊",
    "percent-without-hex": "100% done %zz",
    "url-punctuation": "q?{x}@y;a=b&c+d,$!'()*~:`\"<>",
}


@pytest.mark.parametrize("case", sorted(ADDRESSABLE_NAMES))
def test_tables_under_a_root_with_special_characters_land_in_that_directory(tmp_path, case):
    name = ADDRESSABLE_NAMES[case]
    root = tmp_path / name / "run"
    config = buffer_config(root)
    _write_pin_read(config)
    for table in ("experiences", "batches", "quarantine"):
        assert (root / table / "_delta_log" / "00000000000000000000.json").is_file()
        assert list((root / table).glob("*.parquet"))
    assert DeltaTable(str(root / "experiences")).to_pyarrow_table().num_rows == 4
    # nothing went to an encoded or decoded variant of the name
    assert [p.name for p in tmp_path.iterdir()] == [name]


@pytest.mark.parametrize("via_uri", [False, True], ids=["path", "file-uri"])
def test_a_tables_root_with_special_characters_works_as_a_file_uri_too(tmp_path, via_uri):
    tables = tmp_path / "shared tables #1 ü"
    config = buffer_config(
        tmp_path / "run", tables_root=tables.as_uri() if via_uri else str(tables)
    )
    _write_pin_read(config)
    assert {p.name for p in tables.iterdir()} == {"experiences", "batches", "quarantine"}
    assert [p.name for p in tmp_path.iterdir()] == [tables.name]  # none under the run root


# Legal names deltalake 1.6 mishandles in a table's real path: a write panics ("Invalid object
# store url"), or the path is decoded again or split, so tables would land elsewhere.
UNADDRESSABLE_NAMES = {
    "caret": ("run^1", "'^'"),
    "percent-20": ("my%20runs", "'%20'"),
    "percent-hex": ("a%41b", "'%41'"),
    "pipe": ("a|b", "'|'"),
    "brackets": ("runs[1]", "'[', ']'"),
    "backslash": ("a\\b", repr("\\")),
    "tab": ("a\tb", repr("\t")),
}


@pytest.mark.parametrize("case", sorted(UNADDRESSABLE_NAMES))
def test_a_root_delta_lake_cannot_address_is_refused_before_anything_is_written(tmp_path, case):
    name, shown = UNADDRESSABLE_NAMES[case]
    root = tmp_path / name / "run"
    # the configuration names the key at once, in one line per problem
    with pytest.raises(
        ConfigError, match=rf"run_root: .* contains {re.escape(shown)}, which Delta"
    ):
        buffer_config(root)
    # and the table layer refuses such a location from any other caller
    location = RunPaths.of(root).experiences
    refused = rf"contains {re.escape(shown)}, which Delta Lake cannot address"
    with pytest.raises(ValueError, match=refused):
        open_or_create(location, INPUT_SCHEMA)
    assert not root.exists()


def test_a_safe_link_to_an_unaddressable_directory_is_refused_too(tmp_path):
    """Delta Lake resolves links, so a link does not hide the characters of the real path."""
    real = tmp_path / "run^1"
    real.mkdir()
    link = tmp_path / "run"
    link.symlink_to(real)
    with pytest.raises(ConfigError, match=r"run_root: .* contains '\^'"):
        buffer_config(link)
    with pytest.raises(ValueError, match=r"real path '.*run\^1/experiences'"):
        open_or_create(RunPaths.of(link).experiences, INPUT_SCHEMA)
