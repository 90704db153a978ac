# Two commands on a fresh machine: `make compare` (the main job) and `make test` (the test suite).
# Each creates .venv and installs mixprec with the lab and test extras (mixprec[lab,dev]). Bring your own torch build first
# (CUDA, ROCm or CPU) with `.venv/bin/pip install torch...`; otherwise pip picks PyPI's default.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed

.PHONY: compare test bench clean

compare: $(STAMP)
	$(VENV)/bin/mixprec compare

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/bench_step.py

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e ".[lab,dev]"
	touch $(STAMP)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
