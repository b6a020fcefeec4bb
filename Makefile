# The two commands a newcomer runs: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: run test lint types unit setup clean mutants faults faults-quick

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# CPU torch first, so NIXL's torch dependency does not pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvxferd demo

lint: $(STAMP)
	$(VENV)/bin/ruff check kvxferd tests
	$(VENV)/bin/ruff format --check kvxferd tests

types: $(STAMP)
	$(VENV)/bin/mypy

unit: $(STAMP)
	$(PY) -m pytest -q

# mutants are part of every check: a guarded fix whose revert no test catches fails the build.
test: lint types unit mutants

# Revert each guarded fix in a copy of the tree; every one must make its tests fail
# (56 mutants, two at a time: about 4 min on 2 cores).
mutants: $(STAMP)
	$(PY) tests/mutants.py

# Real daemons through kills, stops, a partition, SIGTERM under load and a soak (a few minutes;
# the partition needs root, ip netns and nft). Writes the figures into docs/reliability.md.
faults: $(STAMP)
	$(VENV)/bin/kvxferd faults --report docs/reliability.md

faults-quick: $(STAMP)
	$(VENV)/bin/kvxferd faults --quick

clean:
	rm -rf $(VENV) build *.egg-info
