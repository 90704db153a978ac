# Two commands on a fresh machine: `make compare` (the main job) and `make test` (the test suite, all
# but the tests marked slow: the model matrix). `make test-slow` runs those; CI runs both.
# Each creates .venv and installs mixprec with what it needs: the lab extra (compare), and the test
# extras (test: mixprec[lab,dev,integrations-test], plus vision-test unless torch is a CPU-only build).
# Bring your own torch build first (CUDA, ROCm or CPU) with `.venv/bin/pip install torch...`;
# otherwise pip picks PyPI's default.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mixprec-installed
TEST_STAMP := $(VENV)/.mixprec-test-installed
# Keep the torch already in the venv (the CPU or CUDA build you chose): pip may not swap it for another.
KEEP_TORCH = $(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" \
	> $(VENV)/constraints.txt 2>/dev/null || : > $(VENV)/constraints.txt

.PHONY: compare test test-slow bench clean

compare: $(STAMP)
	$(VENV)/bin/mixprec compare --device cpu --threads 1

# The suite runs on one worker per core (pytest-xdist), at most 4: each worker imports torch and its
# own copies of the shared models, so more workers buy little time for much memory.
PYTEST := $(PY) -m pytest -q -n auto --maxprocesses 4

test: $(TEST_STAMP)
	$(PYTEST) -m "not slow"

test-slow: $(TEST_STAMP)
	$(PYTEST) -m slow

bench: $(STAMP)
	$(PY) benchmarks/step/bench_step.py

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(KEEP_TORCH)
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[lab]"
	touch $(STAMP)

# The tests also run the Hugging Face and Lightning integrations (mixprec[integrations-test]) and the
# timm/torchvision models (mixprec[vision-test]). PyPI's torchvision is a CUDA build that cannot load
# next to a CPU-only torch (a +cpu version) and would break every import that reaches it: there it is
# left out, and its tests skip saying so.
$(TEST_STAMP): $(STAMP)
	$(KEEP_TORCH)
	@extras=lab,dev,integrations-test; \
	if $(PY) -c "import sys, torch; sys.exit('+cpu' in torch.__version__)"; then extras=$$extras,vision-test; \
	else echo "make: torch is a CPU-only build; leaving out timm and torchvision (PyPI's torchvision is a CUDA build)"; fi; \
	echo "$(PY) -m pip install -q -c $(VENV)/constraints.txt -e \".[$$extras]\""; \
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[$$extras]"
	touch $(TEST_STAMP)

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
