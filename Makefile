# probekit: every target sets itself up on a fresh machine.
#   make test   - create .venv, install torch (CPU build) + probekit[test], run the whole suite
#   make demo   - same set-up, then run the main job headless; outputs under demo_out/
#   make bench  - also create .venv-msprobe (mindstudio-probe 1.0.4) and run the benchmarks
#   make lab    - open JupyterLab on notebooks/

PYTHON ?= python3
VENV ?= .venv
MSPROBE_VENV ?= .venv-msprobe
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=

.PHONY: test demo bench lab chromium clean

$(VENV)/.installed: pyproject.toml
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

chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "installing Debian's chromium for the browser tests"; \
	  $(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# the interop tests run the real msprobe 1.0.4 from its own venv; make them fail, not skip, here
test: $(VENV)/.installed $(MSPROBE_VENV)/.installed chromium
	PROBEKIT_REQUIRE_MSPROBE=1 PROBEKIT_MSPROBE_PYTHON=$(CURDIR)/$(MSPROBE_VENV)/bin/python \
	  $(PY) -m pytest $(PYTEST_ARGS)

demo: $(VENV)/.installed
	$(PY) -m probekit.demo --out demo_out

bench: $(VENV)/.installed $(MSPROBE_VENV)/.installed
	$(PY) benchmarks/run.py --msprobe-python $(MSPROBE_VENV)/bin/python

# the venv's python3 kernel runs `python` from PATH: put the venv first; MPLBACKEND would turn
# off inline plots in the kernels
lab: $(VENV)/.installed
	env -u MPLBACKEND PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/jupyter lab notebooks/

clean:
	rm -rf demo_out test-artifacts bench_out .pytest_cache
