#!/usr/bin/env bash
# The whole test suite as CI runs it: lint, format check, type check, import contracts, then
# every test, slow ones included.
# Extra arguments go to pytest (e.g. `-m "not slow"` for a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$VENV/bin/mypy"  # type check of trinity_dagster/, assets/ and resources/ (pyproject.toml)
"$VENV/bin/lint-imports" --no-logo  # the layers and no-cycle contracts (pyproject.toml)
bash scripts/ensure_programs.sh  # headless Chromium and the PostgreSQL server
exec "$VENV/bin/pytest" "$@"
