# Every target that needs Python first makes sure .venv exists (torch pin first, so pip
# never pulls a CUDA build), then runs from it.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: test test-core test-gpu soak train bench lint format venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[dev]"
	touch $@

test: venv
	$(BIN)/ruff check wholeshard tests examples tools
	$(BIN)/ruff format --check wholeshard tests examples tools
	$(BIN)/python -m pytest -q

test-core: venv
	$(BIN)/python -m pytest -q -m core --durations=10

test-gpu: venv
	$(BIN)/python -m pytest -q -rs -m cuda

soak: venv
	$(BIN)/python -m pytest -q -s -m slow

train: venv
	$(BIN)/wholeshard train $(ARGS)

bench: venv
	$(BIN)/wholeshard bench --json runs/bench.json --png runs/bench.png $(ARGS)

lint: venv
	$(BIN)/ruff check wholeshard tests examples tools

format: venv
	$(BIN)/ruff format wholeshard tests examples tools
	$(BIN)/ruff check --fix wholeshard tests examples tools
