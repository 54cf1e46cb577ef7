# Two commands on a fresh machine: `make run` trains the default job, `make test` runs the
# checks. Each sets itself up: .venv is created and the project installed on first use.

PYTHON ?= python3
VENV ?= .venv
ARGS ?=

.PHONY: run test install docs

run: install  ## train the default job; extra flags with ARGS="--config.max_steps=20"
	$(VENV)/bin/nnx-spmd-train $(ARGS)

test: install  ## lint, type-check and run the tests, as CI does
# Most tests trace, compile and run on one core at a time: two workers, a file each (its
# module fixtures built once). Tests marked serial run their own processes against
# deadlines (Gloo's start, a killed peer named within 30 s): alone, afterwards.
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports --no-cache
	$(VENV)/bin/pytest -m "not serial" -n 2 --dist loadfile
	$(VENV)/bin/pytest -m serial

docs: install  ## the API reference, into docs/_build/html; any warning is an error
	$(VENV)/bin/sphinx-build -W --keep-going -n -b html docs docs/_build/html

install: $(VENV)/bin/nnx-spmd-train

# A file target: done once, and again only when pyproject.toml changes.
$(VENV)/bin/nnx-spmd-train: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -e ".[dev]"
	touch $@
