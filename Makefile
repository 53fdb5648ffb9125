# The two commands a fresh machine needs: `make demo` (the main job) and `make test`.
# Both create the virtual environment on first use. torch is pinned first so that pip takes the
# CPU build from local disk instead of downloading a CUDA build.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: demo test test-all venv clean

demo: $(VENV)/.installed
	$(BIN)/slipstream demo

test: $(VENV)/.installed
	$(BIN)/python -m pytest -q

test-all: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m ""

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) runs
