# `make test`, `make demo` and `make lint` work on a fresh clone: they create
# .venv, install torch only if it is not importable (so a user's CUDA build is
# kept), install this package (editable, with its test/demo extras; `lint`
# adds its lint extra), and run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed
LINT_STAMP := $(VENV)/.installed-lint

.PHONY: venv test test-fast demo bench lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-install when pyproject.toml changes (extras, entry points).
$(STAMP): pyproject.toml | $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,demo]"
	@touch $(STAMP)

venv: $(STAMP)

$(LINT_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install -q -e ".[lint]"
	@touch $(LINT_STAMP)

# ruff on the code, mypy on the package (settings: pyproject.toml). mypy reads
# torch's annotations: the venv's torch is the one type-checked against.
lint: $(LINT_STAMP)
	$(PY) -m ruff check fsdp_compose tests tools benchmarks
	$(PY) -m mypy

test: venv
	$(PY) -m pytest -q tests

# The one-minute tier: the tests that start no worker process (the `fast`
# marker: pure logic, and steps in this process on torch's fake process group).
test-fast: venv
	$(PY) -m pytest -q -m fast tests

demo: venv
	$(VENV)/bin/fsdp-compose demo

# fsdp_compose vs torch FSDP2 / FSDP1 / DDP, side by side (see benchmarks/peers.py)
bench: venv
	@$(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q -e ".[bench]"
	$(PY) -m benchmarks.peers

clean:
	rm -rf $(VENV) build *.egg-info
