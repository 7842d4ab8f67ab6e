# Two entry points: `make demo` (the main job) and `make test`.
# Both create .venv, install what is needed and run on a CPU-only machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The one place the torch version is pinned. An importable torch (system or venv)
# is reused as is, so a CPU box never pulls a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
# Without an NVIDIA driver, take torch's CPU build: the default Linux wheel bundles
# multi-GB CUDA libraries. torch's own dependencies then come from the usual index.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX_ARGS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,--extra-index-url $(TORCH_CPU_INDEX))
PYTEST_ARGS ?= -n 2

.PHONY: demo test test-gpu bench-smoke bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --no-deps "torch==$(TORCH_VERSION)" $(TORCH_INDEX_ARGS)
	$(PY) -m pip install -e ".[all]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

test-gpu: $(VENV)/.installed
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

bench-smoke: $(VENV)/.installed
	$(PY) benchmarks/bench_attention.py --smoke --out benchmarks/results/cpu-smoke

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_attention.py
