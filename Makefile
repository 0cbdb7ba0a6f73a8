# Two commands for a fresh machine (Python 3.10+, no GPU and no network needed beyond the package registry):
#   make demo   set up .venv and run the default experiment (tiny Qwen3 on the synthetic world, about a minute)
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

# torch==2.13.0 first: a bare "torch" requirement would pull several GB of CUDA wheels on a CPU machine.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,wandb,slurm]'
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(PY) train.py

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) scripts/bench_heads.py
	$(PY) scripts/bench_data.py
	$(PY) scripts/bench_lora.py
	$(PY) scripts/bench_mcd.py

clean:
	rm -rf outputs .pytest_cache
