# tokensvc developer commands. `make dev` and `make test` are the two commands a fresh machine needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STATE_DIR ?= .tokensvc-dev

.PHONY: install test-deps dev test test-fast check lint typecheck protolint proto stubs-check pytest bench bench-quality clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

dev: install  ## Install and run tokensvc on embedded defaults (PostgreSQL + dev certificates).
	$(BIN)/tokensvc dev --state-dir $(STATE_DIR)

test-deps:  ## What the tests need beyond PyPI (Prometheus, the Go toolchain and libraries), from Debian when missing.
	tools/setup-test-deps

test: install test-deps  ## Everything CI runs: lint, types, protos, stale stubs, the whole pytest suite (with the Go and Node clients' live tests).
	$(MAKE) check
	$(BIN)/pytest

test-fast: install  ## The suite without the slow end-to-end tests, for a quick loop (CI runs `make test`).
	$(BIN)/pytest -m "not slow"

check: lint typecheck protolint

lint: install
	$(BIN)/ruff check tokensvc tests bench tools
	$(BIN)/ruff format --check tokensvc tests bench tools

typecheck: install
	$(BIN)/mypy

protolint: install  ## buf lint + format; buf breaking against the newest v1.* tag (docs/api.md, "Stability").
	$(BIN)/buf lint
	$(BIN)/buf format --diff --exit-code
	@tag=$$(git tag --list 'v1.*' --sort=-v:refname 2>/dev/null | head -n1); \
	if [ -n "$$tag" ]; then \
		echo "buf breaking --against .git#tag=$$tag"; \
		$(BIN)/buf breaking --against ".git#tag=$$tag"; \
	else \
		echo "no released v1 tag; skipping buf breaking"; \
	fi

proto: install test-deps  ## Regenerate every client's code from protos/ (buf.gen.yaml: tokensvc/v1, clients/go/gen); never edit it by hand.
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/buf generate

bench: install  ## Benchmarks (bench/, docs/benchmarks.md); BENCH_ARGS=--quick / QUALITY_ARGS=--quick for smaller runs.
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench.run $(BENCH_ARGS)
	$(PY) -m bench.cpu --workers 1 2 --rounds 3 --out bench/results/cpu-workers.json $(CPU_ARGS)
	$(PY) -m bench.noisy $(NOISY_ARGS)
	$(PY) -m bench.quality $(QUALITY_ARGS)
	$(PY) -m bench.ingestion $(INGESTION_ARGS)
	$(PY) -m bench.knowledge_scale $(SCALE_ARGS)

bench-quality: install  ## Retrieval quality alone: LoCoMo recall, the knowledge-base question set (bench/quality.py).
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) -m bench.quality $(QUALITY_ARGS)

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
