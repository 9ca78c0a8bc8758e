# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when it is missing.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip --disable-pip-version-check -q
# torch kept as the user has it; otherwise the CPU build on machines without CUDA.
TORCH_CPU_VERSION ?= 2.13.0
STAMP  := $(VENV)/.tandem-installed

.PHONY: install assets demo test test-fast test-stages lint format bench engines-env clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; \
	if [ ! -x "$(PY)" ]; then \
	  if python3 -c "import torch" 2>/dev/null; then \
	    echo "[tandem] creating $(VENV) (reusing the system torch)"; python3 -m venv --system-site-packages $(VENV); \
	  else \
	    echo "[tandem] creating $(VENV)"; python3 -m venv $(VENV); \
	  fi; \
	fi; \
	if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then \
	    echo "[tandem] installing CUDA torch"; $(PIP) install torch; \
	  else \
	    echo "[tandem] installing CPU torch==$(TORCH_CPU_VERSION)"; $(PIP) install "torch==$(TORCH_CPU_VERSION)"; \
	  fi; \
	fi; \
	echo "[tandem] installing tandem and its dependencies"; \
	$(PIP) install -e ".[dev]" 2>&1 | grep -v "^WARNING: Location" || true; \
	$(PY) -c "import tandem, torch, deepspeed, redis, transformers" 2>/dev/null || { echo "[tandem] install failed"; exit 1; }; \
	$(PY) -m tandem.prebuild; \
	touch $(STAMP)

ASSETS := assets/tiny/actor/config.json assets/echo.jsonl

assets/tiny/actor/config.json: | $(STAMP)
	$(PY) -m tandem make-tiny assets/tiny

assets/echo.jsonl: | $(STAMP)
	$(PY) -m tandem make-data echo assets/echo.jsonl --n 2000

demo: $(STAMP) $(ASSETS)
	$(PY) launch.py configs/tiny.yaml

test: $(STAMP)
	$(PY) -m pytest -m "not stages"

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not stages"

test-stages: $(STAMP) $(ASSETS)
	$(PY) -m pytest -m stages

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) bench/buffer.py && $(PY) bench/weightsync.py && $(PY) bench/rollout.py && $(PY) bench/learner.py && $(PY) bench/overlap.py

assets: $(ASSETS)

engines-env:
	bash scripts/engines-env.sh all

clean:
	rm -rf runs .pytest_cache
