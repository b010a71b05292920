# Every target that needs Python first makes sure .venv exists (torch pin first, so pip
# never pulls a CUDA build), then runs from it. CONSTRAINTS pins every other package to the
# versions the suite last passed with (docs/compat.md); `make test CONSTRAINTS=` installs the
# newest releases instead.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
CONSTRAINTS ?= constraints.txt
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q --disable-pip-version-check $(if $(CONSTRAINTS),-c $(CONSTRAINTS))

.PHONY: test test-core test-gpu test-compat constraints soak train bench lint format venv

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) "$(TORCH)"
	$(PIP) -e ".[dev]"
	touch $@

test: venv
	$(BIN)/ruff check wholeshard tests examples tools
	$(BIN)/ruff format --check wholeshard tests examples tools
	$(BIN)/python -m pytest -q --durations=30

test-core: venv
	$(BIN)/python -m pytest -q -m core --durations=10

# Fresh venvs for the declared floors and the newest releases (not in .ci/run: it downloads
# two torch builds); results in docs/results/compat-*.json, rendered into docs/compat.md.
test-compat: venv
	$(BIN)/python tools/measure_compat.py floors newest
	$(BIN)/python tools/make_docs.py

# Pin what .venv holds now (after a passing `make test CONSTRAINTS=`): commit it with that run.
constraints:
	{ echo "# The versions the whole suite last passed with (make test installs them; make constraints"; \
	  echo "# rewrites this file from .venv). torch is pinned by the Makefile's TORCH."; \
	  $(BIN)/pip freeze --exclude-editable --disable-pip-version-check | grep -v -i -E '^(torch|wholeshard)=='; \
	} > constraints.txt

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
