"""Runs one vLLM engine for a test, in its own process (a vLLM engine, its plugins and its
registry live as long as the process): `python engine_child.py JOB.json OUT.json`.

JOB: {"folder", "dtype", "kv_cache_bytes", "max_model_len", "max_num_seqs", "max_tokens",
"calls": [[prompt token ids, ...], ...], "llm_args": other vllm.LLM arguments}.
OUT: {"num_blocks", "block_size", "tokens": per call, per prompt, the greedy new token ids,
"logprobs": and their log-probabilities (vLLM's, from the raw logits),
"plugin": whether the kvcalib side-car served the model, "sequence_bytes": what the plugin keeps
per sequence outside the pages, "row_bytes": its page bytes per token (both 0 without it): rank
0's, "ranks": each tensor-parallel rank's {"plugin", "kv_heads", "row_bytes"}, asked of the
worker processes}.
Set VLLM_PLUGINS="" in the environment to run vLLM without the plugin. With
tensor_parallel_size > 1 each rank's worker is bound to its own core (vLLM's CPU workers
refuse to share one NUMA node unbound).
"""

import json
import os
import sys


def _served(worker) -> dict:
    """What the plugin serves in this worker's process (run there by `collective_rpc`)."""
    if os.environ.get("VLLM_PLUGINS") == "":
        return {"plugin": False}
    from kvcalib_vllm.sidecar import active

    serving = active()
    if serving is None:
        return {"plugin": False}
    return {
        "plugin": True,
        "kv_heads": serving.kv_heads,
        "row_bytes": serving.pages.row_bytes,
        "sequence_bytes": serving.seqs.bytes_per_sequence(),
    }


def main(job_path: str, out_path: str) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    with open(job_path) as f:
        job = json.load(f)
    world = job["llm_args"].get("tensor_parallel_size", 1)
    if world > 1:
        cores = os.cpu_count() or 1
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(r % cores) for r in range(world)))  # fmt: skip
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    args = dict(
        dtype=job["dtype"],
        enforce_eager=True,
        enable_prefix_caching=False,
        kv_cache_memory_bytes=job["kv_cache_bytes"],
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        seed=0,
    )
    llm = LLM(job["folder"], **{**args, **job["llm_args"]})
    greedy = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True,
                            logprobs=0)  # fmt: skip
    tokens, logprobs = [], []
    for call in job["calls"]:
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in call], greedy,
                            use_tqdm=False)  # fmt: skip
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        logprobs.append([
            [step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                                strict=True)]
            for o in outs
        ])  # fmt: skip
    cache = llm.llm_engine.vllm_config.cache_config
    ranks = llm.collective_rpc(_served)
    out = {
        "num_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "tokens": tokens,
        "logprobs": logprobs,
        "plugin": ranks[0]["plugin"],
        "sequence_bytes": ranks[0].get("sequence_bytes", 0),
        "row_bytes": ranks[0].get("row_bytes", 0),
        "ranks": ranks,
    }
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
