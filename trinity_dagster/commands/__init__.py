"""Subcommands of the `trinity-dagster` command, one module each (see `trinity_dagster.cli`)."""
