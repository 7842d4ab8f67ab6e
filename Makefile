# Two entry points: `make demo` (the main job) and `make test`.
# Both create .venv, install what is needed and run on a CPU-only machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The one place the torch version is pinned. An importable torch (system or venv)
# is reused as is, so a CPU box never pulls a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
PYTEST_ARGS ?= -n 2

.PHONY: demo test test-gpu bench-smoke bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==$(TORCH_VERSION)"
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
