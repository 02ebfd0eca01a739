#!/usr/bin/env bash
# The whole test suite as CI runs it: lint, format check, type check, import contracts, then
# every test, slow ones included.
# Extra arguments go to pytest (e.g. `-m "not slow"` for a quick local run).
# Tests run in PYTEST_WORKERS processes (default 2), whole modules to a worker so that a
# module's shared `dagster dev` or engine service serves only its own tests: the end-to-end
# tests spend much of their time waiting on the daemon's ticks, which another module's tests
# fill (the suite took 29 minutes in one process on CI's 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"  # type check of trinity_dagster/, assets/ and resources/ (pyproject.toml)
"$VENV/bin/lint-imports" --no-logo  # the layers and no-cycle contracts (pyproject.toml)
bash scripts/ensure_programs.sh  # headless Chromium and the PostgreSQL server
exec "$VENV/bin/pytest" -n "${PYTEST_WORKERS:-2}" --dist loadfile "$@"
