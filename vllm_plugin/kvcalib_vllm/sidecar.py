"""The side-car this process serves: read once when vLLM builds the model, then asked by the
attention backend (whose hooks vLLM calls without the model) and the model wrapper."""

import vllm
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.platforms import current_platform

from kvcalib_vllm import checks
from kvcalib_vllm.serving import Serving

_ACTIVE: Serving | None = None


def active() -> Serving | None:
    """The Serving of the model this process builds or runs, or None (a folder without a
    side-car: vLLM's own attention serves it)."""
    return _ACTIVE


def activate(vllm_config) -> Serving | None:
    """Read the side-car of vLLM's model folder, if it has one, and check everything the plugin
    refuses (`checks`): KvcalibVllmError in one line, before a weight is read. Under tensor
    parallelism each rank's process serves its share of the KV heads."""
    global _ACTIVE
    _ACTIVE = None
    ckpt = checks.check_folder(vllm_config, vllm.__version__, current_platform.is_cpu())
    if ckpt is None:
        return None
    world = vllm_config.parallel_config.tensor_parallel_size
    rows = 2 * vllm_config.scheduler_config.max_num_seqs  # finished sequences linger a step
    _ACTIVE = Serving(ckpt, dtype=vllm_config.model_config.dtype, rows=rows,
                      max_len=vllm_config.model_config.max_model_len,
                      rank=get_tensor_model_parallel_rank() if world > 1 else 0,
                      world=world)  # fmt: skip
    return _ACTIVE
