# The two set-up commands of the README: `make run` and `make test`. Each installs what it needs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export OMP_NUM_THREADS ?= 2
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
ZAYA_TEST_POSTGRES_URL ?= postgresql+psycopg://postgres@127.0.0.1:5432/test

.PHONY: install test lint run bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first and pinned: an unpinned resolve would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: install
	$(BIN)/ruff check .

# The whole suite (server tests on SQLite), then the database-backed server tests again on PostgreSQL.
test: install lint
	$(BIN)/pytest
	ZAYA_TEST_DATABASE_URL=$(ZAYA_TEST_POSTGRES_URL) $(BIN)/pytest tests/server

run: install
	$(BIN)/python -m server.cli run

bench: install
	$(BIN)/python benchmarks/model_bench.py

clean:
	rm -rf $(VENV) var .pytest_cache
