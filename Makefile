# The two commands a fresh machine needs: `make demo` (the main job) and `make test`.
# Both create the virtual environment on first use. torch is pinned and installed first, so that
# pip takes the CPU build where one is on local disk (as on the project's machines); elsewhere set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu, or pip may download a CUDA build. The other
# packages are installed without compiling their bytecode (transformers alone has ~3,000 modules,
# of which the tests import a few hundred): Python compiles and caches each one it imports.
VENV ?= .venv
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# make test runs the test files in this many processes (pytest-xdist; 0: in this one).
PYTEST_WORKERS ?= 2
BIN := $(VENV)/bin

.PHONY: demo test test-all venv clean

demo: $(VENV)/.installed
	$(BIN)/slipstream demo

# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set: the suite starts ~140 Python
# processes (servers, torchrun workers), and each would compile slipstream's modules again (~0.7 s).
test: $(VENV)/.installed
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile

test-all: $(VENV)/.installed
	env -u PYTHONDONTWRITEBYTECODE $(BIN)/python -m pytest -q -m ""

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(BIN)/python -m pip install -q --no-compile -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) runs
