"""`experiences`: the Delta table explorers append to, observed (row count, table version).

The observation and the check import the data libraries when they run (in a run worker), so
the code server loads this module without them.
"""

import dagster as dg

from resources.run_config import RunConfigResource

EXPERIENCES = "experiences"


@dg.observable_source_asset(
    name=EXPERIENCES,
    group_name="experience",
    description="Delta table of experiences written by explorers (see docs/buffer.md).",
)
def experiences(run_config: RunConfigResource) -> dg.ObserveResult:
    """Row count, table version and unconsumed rows of the experiences table."""
    from trinity_dagster.buffer.stats import table_stats

    stats = table_stats(run_config.config)
    return dg.ObserveResult(
        data_version=dg.DataVersion(str(stats["table_version"])),
        metadata={**stats, "path": dg.MetadataValue.path(run_config.paths.experiences)},
    )


def schema_problems(location: str) -> list[str]:
    """Differences between the Delta table at `location` and the experience schema."""
    import pyarrow as pa

    from trinity_dagster.buffer.schema import EXPERIENCE_SCHEMA
    from trinity_dagster.buffer.tables import open_table

    table = open_table(location)
    if table is None:
        return [f"no Delta table at {location}"]
    actual = {field.name: field for field in pa.schema(table.schema().to_arrow())}
    problems = []
    for field in EXPERIENCE_SCHEMA:
        found = actual.pop(field.name, None)
        if found is None:
            problems.append(f"column {field.name!r} is missing")
        elif not found.type.equals(field.type):
            problems.append(f"column {field.name!r} is {found.type}, expected {field.type}")
    problems += [f"unexpected column {name!r}" for name in actual]
    return problems


@dg.asset_check(asset=EXPERIENCES, description="The table's schema is the experience schema.")
def experience_schema(run_config: RunConfigResource) -> dg.AssetCheckResult:
    """Compare the Delta table's schema with the experience schema, column by column."""
    problems = schema_problems(run_config.paths.experiences)
    return dg.AssetCheckResult(
        passed=not problems, metadata={"problems": "; ".join(problems) or "none"}
    )
