"""What several test modules share: buffer configs, a fake checkpoint provider, a `dagster dev`
for GraphQL tests, a tiny run trained beside the built-in explorer. Fixtures are in
`tests/conftest.py`; the tiny run itself is `trinity_dagster.testing`."""
