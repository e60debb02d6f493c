"""The converted folders the plugin's tests serve (`make test-vllm` makes them with the
toolkit)."""

import os
from pathlib import Path

import pytest


def _folder(var: str) -> Path:
    path = os.environ.get(var)
    if not path or not (Path(path) / "kvcalib.json").is_file():
        pytest.fail(f"set {var} to a kvcalib-converted folder (`make test-vllm` makes it)")
    return Path(path)


@pytest.fixture(scope="session")
def kvcalib2() -> Path:
    """SmolLM2-135M converted with the kvcalib-2 recipe."""
    return _folder("KVCALIB_VLLM_KVCALIB2")


@pytest.fixture(scope="session")
def fp16() -> Path:
    """SmolLM2-135M converted with the fp16 recipe (no quantization)."""
    return _folder("KVCALIB_VLLM_FP16")


@pytest.fixture(scope="session")
def tiny_qwen2() -> Path:
    """A random 2-layer Qwen2 converted with kvcalib-2 less predicted sinks (make_tiny.py)."""
    return _folder("KVCALIB_VLLM_TINY_QWEN2")


@pytest.fixture(scope="session")
def tiny_qwen2_vq() -> Path:
    """The same Qwen2 converted with kvcalib-1.5 (vector codes) less predicted sinks."""
    return _folder("KVCALIB_VLLM_TINY_QWEN2_VQ")


@pytest.fixture(scope="session")
def tiny_qwen2_codebook() -> Path:
    """The same Qwen2 converted with kvcalib-2's values symmetric with a calibrated codebook."""
    return _folder("KVCALIB_VLLM_TINY_QWEN2_CODEBOOK")


@pytest.fixture(scope="session")
def tiny_qwen2_kivi() -> Path:
    """The same Qwen2 converted with kivi-2: per-channel keys, which the plugin refuses."""
    return _folder("KVCALIB_VLLM_TINY_QWEN2_KIVI")
