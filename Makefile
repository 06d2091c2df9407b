# dflash-sglang: setup, serve, test. Everything installs into .venv from the project's own files.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat requirements/cpu.lock pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup system-deps serve test lint bench clean

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
SYSTEM_BINS := prometheus promtool chromium
system-deps:
	@for b in $(SYSTEM_BINS); do command -v $$b >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || (apt-get update -q && DEBIAN_FRONTEND=noninteractive \
	  apt-get install -y -q --no-install-recommends prometheus chromium)

serve: setup
	$(BIN)/python -m dflash_sglang.launch_server $(ARGS)

test: setup system-deps
	$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check dflash_sglang server loadtest tests bench
	$(BIN)/ruff format --check dflash_sglang server loadtest tests bench

bench: setup
	$(BIN)/python bench/bench_ar_vs_dflash.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
