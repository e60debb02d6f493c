"""A vLLM engine run for a test in a child process (`engine_child.py`): an engine, its
plugins and its model registry live as long as their process."""

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = Path(__file__).with_name("engine_child.py")


def run_engine(tmp: Path, folder: Path, calls, *, plugin: bool = True, dtype: str = "float32",
               kv_cache_bytes: int = 64 * 2**20, max_tokens: int = 8, max_num_seqs: int = 4,
               max_model_len: int = 1024, **llm_args) -> dict:  # fmt: skip
    """One vLLM engine on `folder` (with the plugin, or without any), greedy `max_tokens` new
    tokens for each call's prompts (token id lists, batched together): engine_child's OUT.
    llm_args: other vllm.LLM arguments. AssertionError with the child's stderr if it fails."""
    job = dict(
        folder=str(folder),
        dtype=dtype,
        kv_cache_bytes=kv_cache_bytes,
        calls=calls,
        max_tokens=max_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        llm_args=llm_args,
    )
    tmp.mkdir(parents=True, exist_ok=True)
    job_path, out_path = tmp / "job.json", tmp / "out.json"
    job_path.write_text(json.dumps(job))
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # an allow-list naming no plugin
    done = subprocess.run([sys.executable, str(CHILD), str(job_path), str(out_path)], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    if done.returncode:
        raise AssertionError(f"vLLM failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(out_path.read_text())
