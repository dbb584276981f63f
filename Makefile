# specdec in two commands:
#   make          set up (virtual environment, llama-cpp-python built for this CPU, specdec with its extras, the
#                 models the tests use), then run the quick start: the default target and method on an edit
#   make test     the tests (after the same set-up, which is then already done)
# Every step reuses what is there: the venv, the llama-cpp-python wheel cached under ~/.cache/specdec/wheels, the
# models in ~/.cache/specdec. Variables: PYTHON (python3), VENV (.venv), CMAKE_ARGS (e.g. -DGGML_CUDA=on), PYTEST_ARGS.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The models the tests use; the quick start's target (the catalog's default) is the first.
MODELS := qwen2.5-coder-1.5b qwen2.5-coder-0.5b smollm2-135m gemma3-270m
QUICKSTART := specdec_cli/prompts/edit/textwrap_rename.txt
PYTEST_ARGS ?=
export CMAKE_BUILD_PARALLEL_LEVEL ?= $(shell nproc 2>/dev/null || echo 2)

.DEFAULT_GOAL := all
.PHONY: all setup llama-cpp models quickstart test results

all: setup quickstart

setup: $(VENV)/.specdec-installed models

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# llama-cpp-python for this machine (on AMX CPUs patched so its AMX kernels run: llama.cpp issue 20824); ~10 min the first
# time on 2 cores, then the cached wheel; nothing at all when this venv already has it.
llama-cpp: $(BIN)/python
	PYTHON=$(BIN)/python bash scripts/install-llama-cpp.sh

# specdec with its extras, after llama-cpp-python so that pip keeps the build above.
$(VENV)/.specdec-installed: pyproject.toml | llama-cpp
	$(BIN)/python -m pip install -e ".[test,plot,serve]"
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

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# docs/results.md and its data, docs/results.json (benchmarks/results.py): the quick start, the noise floor and free
# text, each a `specdec run --compare`; about 10 minutes on 2 cores. Run it alone on the machine.
results: setup
	$(BIN)/python benchmarks/results.py
