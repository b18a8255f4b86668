# `make demo` and `make test` do all the set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-check lint eval sglang-bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m moe_overlap.tools.demo

test: $(STAMP)
	$(BIN)/python -m pytest tests

# On a machine with GPUs and torch, transformers, safetensors, tokenizers, rich, matplotlib
# and pytest already installed: nothing is installed, the package is read from src/.
gpu-check:
	PYTHONPATH=src $(PY) -m pytest tests/gpu -q -rs

# lm-evaluation-harness against `serve --ep 2` with TBO (installs lm_eval, ~300 MB: not in the
# test extra); its log-likelihoods and generations must equal the offline engine's.
eval: $(STAMP)
	$(BIN)/pip install -q "lm_eval[api]>=0.4.8"
	$(BIN)/python scripts/lm_eval_check.py

# SGLang's own client, `sglang.bench_serving --backend sglang` (native /generate, streaming),
# against `serve --ep 2` with TBO. It gets its own environment: its imports need torchvision,
# which pulls sglang's torch (~6 GB), so sglang is installed without its server's dependencies.
SGLANG_VENV := .venv-sglang
sglang-bench: $(STAMP)
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install -q --no-deps sglang==0.5.23
	$(SGLANG_VENV)/bin/pip install -q torchvision transformers orjson psutil pybase64 msgspec \
		pyzmq ipython datasets sentencepiece compressed-tensors gguf aiohttp requests \
		starlette apache-tvm-ffi
	$(BIN)/python scripts/sglang_bench_check.py $(SGLANG_VENV)/bin/python

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports && $(BIN)/mypy

clean:
	rm -rf $(VENV) $(SGLANG_VENV) out
