"""The file hand-off between the trainer and explorers: the trainer state, sync requests, the
end of data, explorer heartbeats and the control requests of Dagster runs. Below both sides;
stdlib and psutil only."""
