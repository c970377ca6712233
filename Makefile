# probekit: every target sets itself up on a fresh machine.
#   make test   - create .venv, install torch (CPU build) + probekit's test extra, run the whole suite
#                 (the free benchmark's verdict tests again on the avx2 and default CPU kernels)
#   make demo   - same set-up, then run the main job headless; outputs under demo_out/, and the
#                 README's snippets, whose pictures it redraws in docs/img/
#   make docs   - only the README's snippets and pictures
#   make bench  - also create .venv-msprobe (mindstudio-probe 1.0.4), .venv-megatron-core
#                 (megatron-core 0.16.1, for the silent-bug corpus) and .venv-sweep (timm's stack:
#                 torch 2.14.1 + torchvision 0.29.1) and run the benchmarks, the library sweep
#                 (benchmarks/bench_sweep.py) among them
#   make test also creates .venv-mindspore (MindSpore's CPU wheel, numpy < 2, torch, probekit)
#   and runs tests/mindspore there
#   make lab    - open JupyterLab on notebooks/

PYTHON ?= python3
VENV ?= .venv
MSPROBE_VENV ?= .venv-msprobe
MINDSPORE_VENV ?= .venv-mindspore
# benchmarks/bench_sweep.py's timm half: timm imports torchvision, whose PyPI build does not load
# beside the CPU torch of .venv, so it gets a venv of its own with a matching pair
SWEEP_VENV ?= .venv-sweep
SWEEP_TORCH ?= torch==2.14.1 torchvision==0.29.1
# the one tested; its wheel is built against numpy 1.x (hence numpy<2 in probekit's mindspore extra)
MINDSPORE ?= mindspore==2.10.0
TORCH ?= torch==2.13.0
# the silent-bug corpus runs Megatron's own layers: 0.16.1 is the newest for Python 3.11 (0.17 and
# later need 3.12); it needs nothing beyond torch, numpy and packaging, so it goes into a folder of
# its own (pip --target, no deps) that the bench puts on the path: the test venv is untouched
MEGATRON_CORE ?= megatron-core==0.16.1
MEGATRON_DIR ?= .venv-megatron-core
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: test kernel-paths demo docs bench lab chromium clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -U pip
	$(PIP) install "$(TORCH)"
	$(PIP) install -e ".[test]"
	touch $@

$(MSPROBE_VENV)/.installed:
	test -x $(MSPROBE_VENV)/bin/python || $(PYTHON) -m venv $(MSPROBE_VENV)
	$(MSPROBE_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH)"
	$(MSPROBE_VENV)/bin/python -m pip --disable-pip-version-check -q install mindstudio-probe==1.0.4
	touch $@

$(MEGATRON_DIR)/.installed: $(VENV)/.installed
	$(PIP) install --no-deps --target $(MEGATRON_DIR) "$(MEGATRON_CORE)"
	touch $@

$(MINDSPORE_VENV)/.installed: pyproject.toml setup.py
	test -x $(MINDSPORE_VENV)/bin/python || $(PYTHON) -m venv $(MINDSPORE_VENV)
	$(MINDSPORE_VENV)/bin/python -m pip --disable-pip-version-check -q install -U pip
	$(MINDSPORE_VENV)/bin/python -m pip --disable-pip-version-check -q install "$(TORCH)"
	$(MINDSPORE_VENV)/bin/python -m pip --disable-pip-version-check -q install -e ".[mindspore]" \
	  "$(MINDSPORE)" pytest pytest-timeout
	touch $@

$(SWEEP_VENV)/.installed: pyproject.toml setup.py
	test -x $(SWEEP_VENV)/bin/python || $(PYTHON) -m venv $(SWEEP_VENV)
	$(SWEEP_VENV)/bin/python -m pip --disable-pip-version-check -q install -U pip
	$(SWEEP_VENV)/bin/python -m pip --disable-pip-version-check -q install $(SWEEP_TORCH)
	$(SWEEP_VENV)/bin/python -m pip --disable-pip-version-check -q install -e ".[bench]"
	touch $@

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# the free benchmark's verdicts must not depend on the CPU's vector kernels: its detection,
# triage and notebook tests run again on x86's other kernel paths (skipped where torch does not
# honour ATEN_CPU_CAPABILITY, e.g. on ARM)
KERNEL_PATHS ?= avx2 default
KERNEL_PATH_TESTS ?= tests/unit/test_freebench_detection.py tests/unit/test_freebench_cause.py \
  tests/unit/test_freebench_random.py tests/integration/test_triage.py \
  "tests/notebook/test_notebooks.py::test_notebook_runs_clean[01_quickstart.ipynb]" \
  "tests/notebook/test_notebooks.py::test_notebook_runs_clean[02_free_benchmark.ipynb]"

# the interop tests run the real msprobe 1.0.4 from its own venv, the MindSpore tests run in
# theirs; make them fail, not skip, here
test: $(VENV)/.installed $(MSPROBE_VENV)/.installed $(MINDSPORE_VENV)/.installed chromium
	PROBEKIT_REQUIRE_MSPROBE=1 PROBEKIT_MSPROBE_PYTHON=$(CURDIR)/$(MSPROBE_VENV)/bin/python \
	  $(PY) -m pytest --ignore=tests/mindspore $(PYTEST_ARGS)
	PROBEKIT_REQUIRE_MINDSPORE=1 PROBEKIT_NUMPY2_PYTHON=$(CURDIR)/$(PY) \
	  $(MINDSPORE_VENV)/bin/python -m pytest tests/mindspore $(PYTEST_ARGS)
	$(MAKE) --no-print-directory kernel-paths

kernel-paths: $(VENV)/.installed
	@for cap in $(KERNEL_PATHS); do \
	  if ATEN_CPU_CAPABILITY=$$cap $(PY) -c "import sys, torch; \
	    sys.exit(torch.backends.cpu.get_cpu_capability() != '$$cap'.upper())"; then \
	    echo "== free benchmark verdicts on the $$cap CPU kernels"; \
	    ATEN_CPU_CAPABILITY=$$cap $(PY) -m pytest -q $(KERNEL_PATH_TESTS) $(PYTEST_ARGS) || exit 1; \
	  else echo "== $$cap CPU kernels: not available here, skipped"; fi; \
	done

demo: $(VENV)/.installed
	$(PY) -m probekit.demo --out demo_out --pictures docs/img

docs: $(VENV)/.installed
	$(PY) -m probekit.demo --out demo_out --pictures docs/img --no-notebooks

bench: $(VENV)/.installed $(MSPROBE_VENV)/.installed $(MINDSPORE_VENV)/.installed \
  $(MEGATRON_DIR)/.installed $(SWEEP_VENV)/.installed
	$(PY) benchmarks/run.py --msprobe-python $(MSPROBE_VENV)/bin/python \
	  --sweep-timm-python $(SWEEP_VENV)/bin/python
	$(MINDSPORE_VENV)/bin/python benchmarks/bench_mindspore.py --out bench_out/mindspore.json \
	  --results benchmarks/RESULTS.md
	PROBEKIT_MEGATRON_CORE=$(CURDIR)/$(MEGATRON_DIR) $(PY) benchmarks/bench_silent_bugs.py \
	  --out bench_out/silent_bugs.json --results benchmarks/RESULTS.md

# the venv's python3 kernel runs `python` from PATH: put the venv first; MPLBACKEND would turn
# off inline plots in the kernels
lab: $(VENV)/.installed
	env -u MPLBACKEND PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf demo_out test-artifacts bench_out .pytest_cache
