# Two commands for a fresh machine (Python 3.10+, no GPU and no network needed beyond the package registry):
#   make demo   set up .venv and run the default experiment (tiny Qwen3 on the synthetic world, about 30 s)
#   make test   set up .venv, lint, and run the test suite (about 5 min on a fresh clone with 2 cores)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-all bench clean

# torch==2.13.0 first: a bare "torch" requirement would pull several GB of CUDA wheels on a CPU machine.
# Byte-compiled once, on all cores, instead of file by file inside pip (100 s -> 80 s on 2 cores); the .pyc files
# matter where PYTHONDONTWRITEBYTECODE is set, as every process would compile torch again. compileall's status is
# ignored as pip ignores it: a few files in the packages are not Python 3.11 (e.g. torch's py312_intrinsics.py).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile torch==2.13.0
	$(PY) -m pip install --quiet --no-compile -e '.[dev,wandb,slurm]'
	$(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) train.py

# Lint, then the tests on two workers (pytest-xdist): whole files per worker, so a file's fixtures are made once, in
# the order tests/conftest.py gives (longest first).
# Tests marked slow are left out here: each one checks a capability that a fast test also covers (README, Tests).
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test: setup
	$(PY) -m ruff check .
	$(PYTEST) -m "not slow"

# Everything, slow end-to-end checks included (torchrun launches, default-size acceptance runs).
test-all: setup
	$(PY) -m ruff check .
	$(PYTEST)

bench: setup
	$(PY) scripts/bench_heads.py
	$(PY) scripts/bench_data.py
	$(PY) scripts/bench_lora.py
	$(PY) scripts/bench_mcd.py

clean:
	rm -rf outputs .pytest_cache
