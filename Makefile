# specdec in two commands:
#   make          set up (virtual environment, llama-cpp-python built for this machine, specdec with its extras, the
#                 models the tests use), then run the quick start: the default target and method on an edit
#   make test     the checks (`make lint`: ruff and mypy), then the tests (after the same set-up, which is then
#                 already done)
# Every step reuses what is there: the venv, the llama-cpp-python wheel cached under ~/.cache/specdec/wheels, the
# models in ~/.cache/specdec. Variables: PYTHON (python3: the one .venv is made with, 3.11+), VENV (.venv), BACKEND
# (auto: Metal on Apple Silicon, CUDA where nvcc and an NVIDIA GPU are found, else the CPU; or cpu, metal, cuda,
# vulkan), CMAKE_ARGS (appended to the build's, e.g. -DCMAKE_CUDA_ARCHITECTURES=89), PYTEST_ARGS.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BACKEND ?= auto
# The models the tests use; the quick start's target (the catalog's default) is the first.
MODELS := qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m gemma3-270m
QUICKSTART := specdec_cli/prompts/edit/textwrap_rename.txt
PYTEST_ARGS ?=

# Before anything is made: the Python that makes .venv must be 3.11+ (macOS's python3 may be the command-line tools'
# 3.9, which would fail only after the long compile). One line naming the fix, at once; skipped once .venv exists.
ifeq ($(wildcard $(BIN)/python),)
PYTHON_PROBLEM := $(shell $(PYTHON) -c 'import sys; v = sys.version_info; print("" if v >= (3, 11) else \
  "specdec needs Python 3.11+; this is %d.%d ($(PYTHON)). Run: make PYTHON=python3.12" % (v[0], v[1]))' 2>/dev/null \
  || echo "specdec needs Python 3.11+; $(PYTHON) did not run. Run: make PYTHON=python3.12")
ifneq ($(PYTHON_PROBLEM),)
$(error $(PYTHON_PROBLEM))
endif
endif

.DEFAULT_GOAL := all
.PHONY: all setup llama-cpp models quickstart lint test results

all: setup quickstart

setup: $(VENV)/.specdec-installed models

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# llama-cpp-python for this machine and its GPU (BACKEND), patched (the flash-attention switch; on AMX CPUs the fix that
# makes its AMX kernels run: llama.cpp issue 20824); ~6 min the first time on 2 cores, compiling on every CPU
# (CMAKE_BUILD_PARALLEL_LEVEL), then the cached wheel; nothing at all when this venv already has it. Python, no bash:
# an installed specdec runs the same module with `specdec install-llama-cpp`.
llama-cpp: $(BIN)/python
	$(BIN)/python specdec_cli/llama_build/install.py --backend $(BACKEND)

# specdec with its extras, after llama-cpp-python so that pip keeps the build above. The distribution was called
# "specdec" before it became specdec-cli: an older install of it in this venv is removed first.
$(VENV)/.specdec-installed: pyproject.toml | llama-cpp
	$(BIN)/python -m pip uninstall --yes --quiet specdec 2>/dev/null || true
	$(BIN)/python -m pip install -e ".[test,lint,plot,serve]"
	$(BIN)/python -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
	$(BIN)/specdec --version
	touch $@

# Verified by sha256, with progress bars; models already present are skipped.
models: $(VENV)/.specdec-installed
	$(BIN)/specdec models pull $(MODELS)

# The default (--method auto, the default target) on an edit, where prompt lookup pays; --compare: the speedup
# over plain decoding, the median of 3 interleaved pairs with its min-max.
quickstart: setup
	$(BIN)/specdec run $(QUICKSTART) -n 256 --compare

# ruff's lint and format check, and mypy on the package ([tool.ruff] and [tool.mypy] in pyproject.toml). `ruff format`
# applies the formatting, `ruff check --fix` the safe fixes.
lint: $(VENV)/.specdec-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: setup lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# docs/results.md and its data, docs/results.json (benchmarks/results.py): the quick start, the noise floor and free
# text, each a `specdec run --compare`; about 10 minutes on 2 cores. Run it alone on the machine.
results: setup
	$(BIN)/python benchmarks/results.py
