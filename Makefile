# Two commands on a fresh machine (see README): `make demo` runs the main job, `make test` the tests.
# Both create .venv and install everything the project needs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
BPO := $(VENV)/bin/bpo
# torch first and pinned: a local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
EXTRAS ?= all

.PHONY: setup demo test lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	touch $@

demo: setup
	OMP_WAIT_POLICY=PASSIVE $(BPO) verify

test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
