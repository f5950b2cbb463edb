# pt2flow: two commands do all the set-up on a fresh machine.
#   make demo   create .venv, install pinned dependencies, run configs/demo.yaml (then its models to
#               every deployment target, configs/targets.yaml, then the generative models of
#               configs/generative.yaml, then the int8 deployments of configs/quantized.yaml) into
#               ./pt2-store; DEMO_ARGS="--only mlp" passes arguments to the first two runs,
#               GENERATIVE_ARGS="--only tiny-llama" to the third, QUANTIZED_ARGS to the fourth (the
#               README's test runs a small part of the demo)
#   make test   the same install, then the whole test suite (every tier), the docs site built strict
#               and read in headless Chromium (Debian's chromium: `make browser` installs it when missing)
#   make docs   the documentation site (mkdocs.yml, docs/) into site/, strict; make docs-serve serves it
#
# Prefect runs offline with its ephemeral server; PREFECT_HOME is project-local, telemetry off.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
STORE ?= ./pt2-store
DEMO_ARGS ?=
GENERATIVE_ARGS ?=
QUANTIZED_ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers of `make test` and `make test-fast`: 2 on this project's 2-core machines
# (measured: docs/architecture.md, "Testing"); TEST_WORKERS=0 runs every test in one process
TEST_WORKERS ?= 2
# a test's group is its file, or the fleet it shares, longest groups first (tests/session.py); the 40 slowest tests and
# the time per tier and per file are printed after every run (CI's log shows where time went)
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=40

export PREFECT_HOME := $(CURDIR)/.prefect
# Python writes bytecode (__pycache__/, git-ignored) in every recipe, even where the environment says
# not to (PYTHONDONTWRITEBYTECODE=1 is set on this project's machines, as in many container images).
# Without it every process compiled pt2flow's own modules from source again (the install compiles
# the venv's packages, not the editable tree): about 0.8 s of CPU per `pt2flow` command, fork server
# or script, and pytest rewrote every test module's asserts again in each worker (a collection:
# 19 s -> 12 s of CPU).
export PYTHONDONTWRITEBYTECODE :=
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: install demo test test-fast lint fmt clean docs docs-serve browser bench-torch-upgrade bench-exportdb-compile bench-generation

install: $(STAMP)

# torch is installed first and exactly: 2.13.0, the CPU build. pip takes it from TORCH_INDEX when it
# is set (TORCH_INDEX=https://download.pytorch.org/whl/cpu is PyTorch's own index of CPU builds),
# else from pip's own configuration: on this project's machines a local file of the CPU build;
# elsewhere PyPI, whose torch 2.13.0 for Linux x86_64 is the CUDA build (several GB). A looser
# requirement would pull that CUDA build too. requirements.lock pins every other package.
TORCH_INDEX ?=
# Every extra of pyproject.toml is installed (EXTRAS: the test tools and each target's libraries),
# so `make test` covers every stage; a new target's extra is picked up without editing this file.
# executorch 1.5.1 names no torch requirement, so it cannot replace torch 2.13.0; the lock pins
# what it pulls (hydra-core forces antlr4-python3-runtime 4.9.*, which moto[server] accepts).
# The last line fails the install if anything ever replaced torch 2.13.0.
EXTRAS = $(shell $(PYTHON) -c "import tomllib; print(','.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']))")

# pip prints each step (what it collects, each download with its size); `du` prints the venv's size.
# pip installs without byte-compiling (its compile step runs on one core: about half of the
# install's CPU); compileall then compiles the venv on every core, but not the packages' own test
# suites (folders named test or tests under site-packages: a fifth of the venv's source, never
# imported by a run or the tests; a process that does import one compiles it then). Its exit status
# is ignored as pip's own compile step ignores failures: a few distributions ship files that are
# not Python 3.11 (torch's testing/_internal/py312_intrinsics.py).
$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "make install [1/4]: torch==2.13.0 (CPU build) into $(VENV), from $(or $(TORCH_INDEX),pip's configured index)"
	$(BIN)/python -m pip install --disable-pip-version-check --no-compile --progress-bar off $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) "torch==2.13.0"
	@echo "make install [2/4]: requirements.lock and pt2flow's extras ($(EXTRAS)) into $(VENV)"
	$(BIN)/python -m pip install --disable-pip-version-check --no-compile --progress-bar off -c requirements.lock -e ".[$(EXTRAS)]"
	@echo "make install [3/4]: byte-compiling $(VENV) on every core"
	$(BIN)/python -m compileall -qq -j 0 -x 'site-packages/.*/tests?/' $(VENV)/lib || true
	$(BIN)/python -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else f'torch {torch.__version__} replaced 2.13.0')"
	@echo "make install [4/4]: done, $$(du -sh $(VENV) | cut -f1) in $(VENV)"
	touch $(STAMP)

demo: install
	$(BIN)/pt2flow run configs/demo.yaml --store $(STORE) $(DEMO_ARGS)
	$(BIN)/pt2flow run configs/targets.yaml --store $(STORE) $(DEMO_ARGS)
	$(BIN)/pt2flow run configs/generative.yaml --store $(STORE) $(GENERATIVE_ARGS)
	$(BIN)/pt2flow run configs/quantized.yaml --store $(STORE) $(QUANTIZED_ARGS)

# the tree's bytecode is written before the tests start: a folder that gains a __pycache__/ later
# changes its mtime under a running fork server that imports from it (a stale server, started again)
BYTECODE = $(BIN)/python -m compileall -q -j 0 $(wildcard flows stages storage tests bench configs docs) > /dev/null

# ruff (pyproject's [tool.ruff]) on the folders a clone has: the lint, and the format the tree keeps
RUFF_PATHS = $(wildcard flows stages storage tests bench configs docs)

test: install browser
	$(BIN)/lint-imports
	$(BIN)/ruff check --quiet $(RUFF_PATHS)
	$(BIN)/ruff format --check --quiet $(RUFF_PATHS)
	$(BYTECODE)
	$(BIN)/python -m pytest $(XDIST) $(PYTEST_ARGS)

# the documentation site (mkdocs.yml): strict, so a broken link or anchor, a page missing from the
# nav or a docstring mkdocstrings cannot read fails the build; tests/test_docs.py builds it too
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

docs-serve: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8000

# the headless browser the site's test reads every page in (and the drift report's HTML test):
# Debian's chromium, installed with apt when it is missing and this is root on a Debian-like
# machine (CI's case); otherwise say how, and the site's test fails naming it
browser:
	@command -v chromium > /dev/null || command -v chromium-browser > /dev/null \
	  || { [ "$$(id -u)" = 0 ] && command -v apt-get > /dev/null \
	       && echo "make browser: installing Debian's chromium (about 100 MB)" \
	       && apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium > /dev/null; } \
	  || echo "make browser: no chromium, and cannot install it here: install Debian's chromium package (tests/test_docs.py needs it)"

# the developer's quick loop (under 3 minutes): no AOTInductor compiles, no end-to-end runs, no
# subprocess of pt2flow, no export beyond tiny in-process models
test-fast: install
	$(BYTECODE)
	$(BIN)/python -m pytest -m "not compile and not integration" $(XDIST) $(PYTEST_ARGS)

# a real torch upgrade through upgrade-check (bench/torch_upgrade.py): builds a torch 2.14.1 candidate
# virtualenv under .cache/ once (about 6 GB: the CUDA build from the local wheel cache, run on the
# CPU), then the mixed fleet under both torches; the reports land in bench/results/torch_upgrade/.
# Not part of `make test`.
bench-torch-upgrade: install
	$(BIN)/python bench/torch_upgrade.py

# torch's ExportDB through AOTInductor (bench/exportdb_compile.py): the three cases `make test` once
# compiled; `CASES=` empty for every case
CASES ?= user_input_mutation,fn_with_kwargs,cond_operands
bench-exportdb-compile: install
	$(BIN)/python bench/exportdb_compile.py $(if $(CASES),--cases $(CASES))

# every generative architecture to every artifact kind through pt2flow's stage functions
# (bench/generation.py --artifacts --check): the AOTInductor packages and .ptes of Qwen2, Gemma and
# Phi3, which `make test` does not build (it builds tiny Llama's and T5's); exit 1 if an artifact
# does not build or generates other tokens than eager. About 6 minutes on 2 cores.
bench-generation: install
	$(BIN)/python bench/generation.py --artifacts archive,pte,onnx,aoti,openvino --tokens 32 --repeats 1 --check

lint: install
	$(BIN)/lint-imports
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)

# the tree's lint fixes and format, applied (what `make test` checks)
fmt: install
	$(BIN)/ruff check --fix $(RUFF_PATHS)
	$(BIN)/ruff format $(RUFF_PATHS)

# clean stops pt2flow's shared Prefect servers first: the one of ./.prefect (make's PREFECT_HOME), and
# the one a `pt2flow run` outside make started under Prefect's default home, ~/.prefect, unless a run
# still uses it (flows/engine/services/prefect_server.py `stop`; either stops by itself after its idle time).
clean:
	-@python3 -I flows/engine/services/prefect_server.py stop .prefect
	-@python3 -I flows/engine/services/prefect_server.py stop --if-idle $(HOME)/.prefect
	rm -rf $(VENV) .prefect $(STORE) pt2-store-failures pt2-store-generative .pytest_cache \
	  .cache .mypy_cache .hypothesis .import_linter_cache .ruff_cache pt2flow.egg-info site build dist \
	  tests/fixtures/*/build tests/fixtures/*/*.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
