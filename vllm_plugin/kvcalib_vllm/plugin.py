"""vLLM's way in: the `vllm.general_plugins` entry point (pyproject.toml) calls `register` in
every vLLM process before a model is built."""

import logging

import vllm
from vllm import ModelRegistry
from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

from kvcalib_vllm import checks

log = logging.getLogger(__name__)


def register() -> None:
    """Register the model classes that read a folder's side-car (`model`), and, in a vLLM the
    plugin serves, the attention backend that stores it (`attention`, over CPU_ATTN). In
    another vLLM only the model classes are registered: they refuse a converted folder in one
    line and leave every other model as vLLM builds it."""
    for arch in checks.ARCHITECTURES:
        ModelRegistry.register_model(arch, f"kvcalib_vllm.model:Kvcalib{arch}")
    try:
        checks.check_version(vllm.__version__)
    except checks.KvcalibVllmError as e:
        log.warning("%s", e)
        return
    register_backend(AttentionBackendEnum.CPU_ATTN, "kvcalib_vllm.attention.KvcalibBackend")
