# `make demo` and `make test` do all the set-up on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test gpu-check lint eval clean

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

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check . && $(BIN)/lint-imports && $(BIN)/mypy

clean:
	rm -rf $(VENV) out
