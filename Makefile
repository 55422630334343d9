# `make train` and `make test` create .venv on first use and reuse it afterwards.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: train test test-integration lint format docs clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet -e '.[dev,tpu]'
	# XLA's GPU compiler for GPU plans, kept out of JAX's plugins so no other command loads it
	$(VENV)/bin/python -m pip install --quiet --no-deps --target $(VENV)/cuda-compiler \
		"jax-cuda12-pjrt==$$($(VENV)/bin/python -c 'import jax; print(jax.__version__)')"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/podtrain train $(ARGS)

# Two workers: compiling is mostly single-threaded, so a 2-core machine runs two test files at once.
PYTEST_ARGS ?= -n 2 --dist loadfile

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS)

# 20 s to minutes of end-to-end work each: the shipped recipes trained or planned at their size
# (they learn, they fit), processes killed at random and restarted, the larger compiles for a TPU
# or GPU (smaller ones stay in `make test`). CI runs them after `make test`.
test-integration: $(STAMP)
	$(VENV)/bin/python -m pytest -q $(PYTEST_ARGS) -m integration

lint: $(STAMP)
	$(VENV)/bin/ruff format --check podtrain tests bench
	$(VENV)/bin/ruff check podtrain tests bench

format: $(STAMP)
	$(VENV)/bin/ruff format podtrain tests bench
	$(VENV)/bin/ruff check --fix podtrain tests bench

# docs/configuration.md from the config schema; tests/test_docs.py fails when it is stale.
docs: $(STAMP)
	$(VENV)/bin/python -m podtrain.tools.config_docs > docs/configuration.md.tmp \
		&& mv docs/configuration.md.tmp docs/configuration.md || { rm -f docs/configuration.md.tmp; exit 1; }

clean:
	rm -rf $(VENV) runs
