# Two entry points (see README): `make demo` and `make test`. Both create .venv and install
# everything on first use. TORCH_SPEC is installed before the project so pip takes the CPU
# build on disk instead of downloading a CUDA build of several GB.
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_ARGS ?=

.PHONY: install demo test lint format

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: install
	$(VENV)/bin/trinity-dagster demo $(DEMO_ARGS)

test: install
	bash scripts/test.sh

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy \
		&& $(VENV)/bin/lint-imports --no-logo

format: install
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .
