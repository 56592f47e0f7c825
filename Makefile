# splitstream — `make help` lists the targets.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# tritonclient pins protobuf<7 and registers the same `inference.*` protobuf
# symbols as our stubs, so the external-client tests run it from its own venv.
TRITON_VENV ?= .venv-triton
# LiteLLM's proxy (an OpenAI-compatible server of its own, answering mock responses) is the independent
# `openai` upstream of the upstream tests; its many pins live in their own venv.
LITELLM_VENV ?= .venv-litellm
# The HTTP stacks the router's own (aiohttp) is measured against: bench/http_stack.py only.
BENCH_VENV ?= .venv-bench
TEST_ENV = SPLITSTREAM_TRITON_PYTHON=$(abspath $(TRITON_VENV))/bin/python SPLITSTREAM_LITELLM=$(abspath $(LITELLM_VENV))/bin/litellm

.DEFAULT_GOAL := help
.PHONY: help install protos test test-fast lint format bench bench-http gpu-smoke clean up down up-tls down-tls demo demo-llm

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

# The stubs are part of the package, so they are generated before it is installed.
$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet 'grpcio-tools>=1.80,<2' 'mypy-protobuf>=3.6,<6'
	$(BIN)/python scripts/gen_protos.py
	$(BIN)/pip install --quiet -e '.[dev,demo]'
	@touch $@

$(TRITON_VENV)/.installed:
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install --quiet --upgrade pip
	$(TRITON_VENV)/bin/pip install --quiet 'tritonclient[grpc,http]>=2.50,<3' 'numpy>=1.26,<3'
	@touch $@

$(LITELLM_VENV)/.installed:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/pip install --quiet --upgrade pip
	$(LITELLM_VENV)/bin/pip install --quiet 'litellm[proxy]>=1.50,<2'
	@touch $@

$(BENCH_VENV)/.installed:
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet 'aiohttp>=3.10,<4' 'uvicorn[standard]>=0.30,<1' 'starlette>=0.40,<2' \
		'httpx>=0.27,<1' 'granian>=2,<3'
	@touch $@

install: $(BIN)/.installed protos ## Create .venv, install splitstream (editable) with dev tools, generate stubs

protos: $(BIN)/.installed ## Generate Python stubs (+ .pyi) from protos/
	@$(BIN)/python scripts/gen_protos.py

# Test processes in parallel (pytest-xdist): two per core, since a test spends much of its time waiting on
# the processes it started (measured in docs/development.md); 0 runs the suite in this process.
TEST_WORKERS ?= $(shell echo $$((2 * $$(nproc 2>/dev/null || echo 1))))

test: install $(TRITON_VENV)/.installed $(LITELLM_VENV)/.installed ## Set up and run the whole test suite
	$(TEST_ENV) $(BIN)/pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: install $(TRITON_VENV)/.installed $(LITELLM_VENV)/.installed ## The inner loop: every test but those marked slow (a few minutes)
	$(TEST_ENV) $(BIN)/pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder -m 'not slow' $(PYTEST_ARGS)

lint: install ## ruff (lint + format check) and mypy
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy services tests bench demo

format: install ## Apply ruff's fixes and formatting
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: install ## Run the benchmarks (prints tables; see docs/benchmarks.md)
	$(BIN)/python bench/router_overhead.py
	$(BIN)/python bench/dynamic_batching.py
	$(BIN)/python bench/recorder_throughput.py
	$(BIN)/python bench/recording_overhead.py
	@if command -v valgrind >/dev/null; then $(BIN)/python bench/recording_instructions.py; \
	else echo "bench/recording_instructions.py not run: it needs valgrind (apt-get install valgrind)"; fi
	$(BIN)/python bench/replay_send_lag.py
	$(BIN)/python bench/streaming.py
	$(BIN)/python bench/exposures_feedback.py
	$(BIN)/python bench/analysis.py
	$(BIN)/python bench/analysis_scale.py

bench-http: install $(LITELLM_VENV)/.installed $(BENCH_VENV)/.installed ## HTTP hop overhead (router, floor, LiteLLM, nginx) and the HTTP stack comparison
	@command -v nginx >/dev/null || echo "nginx not installed: its row is left out (apt-get install nginx)"
	$(BIN)/python bench/http_overhead.py --litellm $(LITELLM_VENV)/bin/litellm
	$(BIN)/python bench/http_stack.py --bench-python $(BENCH_VENV)/bin/python

demo: install ## The whole story on this machine: train, split 90/10, record, ramp to 50/50, replay, report
	$(BIN)/python -m demo.run

demo-llm: install ## Token streams: bigram v1 and trigram v2 behind a 50/50 router, recorded, replayed, noise floor; OpenAI chats rated, judged
	$(BIN)/python -m demo.llm

up: ## Start the docker-compose stack (needs a Docker engine): redis, consul, recorder, router, workers, prometheus, grafana
	docker compose -f deploy/docker-compose.yml up --build --detach

down: ## Stop the docker-compose stack
	docker compose -f deploy/docker-compose.yml down

up-tls: ## The same stack with TLS on every hop (certificates made at start by a one-shot container)
	docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.tls.yml up --build --detach

down-tls: ## Stop the TLS stack
	docker compose -f deploy/docker-compose.yml -f deploy/docker-compose.tls.yml down

gpu-smoke: install ## On a GPU machine: build, load and time a TensorRT engine against ONNX Runtime
	$(BIN)/pip install --quiet -e '.[tensorrt]'
	$(BIN)/python bench/gpu_smoke.py

clean: ## Remove the virtual environments and generated files
	rm -rf $(VENV) $(TRITON_VENV) $(BENCH_VENV) $(LITELLM_VENV) services/common/proto .pytest_cache .ruff_cache .mypy_cache
