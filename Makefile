# `make test` and `make demo` work on a fresh clone: they create .venv, install
# torch only if it is not importable (so a user's CUDA build is kept), install
# this package, and run.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: venv test demo bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)

venv: $(PY)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	@$(PY) -c "import fsdp_compose, pytest, expecttest, tqdm" 2>/dev/null || $(PY) -m pip install -q -e ".[test,demo]"

test: venv
	$(PY) -m pytest -q tests

demo: venv
	$(VENV)/bin/fsdp-compose demo

clean:
	rm -rf $(VENV) build *.egg-info
