"""The vLLM plugin's memory numbers the README and docs/serving.md state (a token's bytes in the
plugin's pages against vLLM's fp16 cache, and the blocks each makes at 256 MiB) are what the
plugin's page layout computes for kvcalib-2 on SmolLM2-135M: a changed layout or plan that moves
them fails here, not in a reader's hands. No vLLM needed: the layout is the runtime's."""

import re
import sys
from pathlib import Path

import pytest
import torch

import kvcalib
import kvcalib_runtime

ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "benchmarks" / "long_context" / "smollm2-135m" / "profile"
MEMORY, BLOCK = 256 << 20, 128  # the numbers' setting: 256 MiB of KV memory, blocks of 128


def _text(page: str) -> str:
    return " ".join((ROOT / page).read_text().split())  # line breaks as spaces


@pytest.mark.slow  # converts SmolLM2-135M with kvcalib-2 (the committed profile): ~10 s
def test_page_numbers_are_the_layouts(tmp_path):
    sys.path.append(str(ROOT / "vllm_plugin"))  # the plugin's own package, not installed here
    from kvcalib_vllm.pages import PageLayout

    kvcalib.convert(None, recipe="kvcalib-2", profile=PROFILE, output=tmp_path / "converted")
    m = kvcalib_runtime.load(tmp_path / "converted", device="cpu")
    pages = PageLayout(m.scheme, m.params, kv_heads=m.kv_heads, head_dim=m.head_dim,
                       dtype=torch.float16)  # fmt: skip
    ours, fp16 = pages.row_bytes, pages.fp_row_bytes(torch.float16)
    blocks, fp_blocks = MEMORY // (BLOCK * ours), MEMORY // (BLOCK * fp16)
    readme, serving = _text("README.md"), _text("docs/serving.md")
    assert f"{ours:,} bytes in vLLM's pages against vLLM's {fp16:,} in fp16" in readme
    assert (
        f"{blocks} blocks of {BLOCK} tokens against {fp_blocks} ({blocks / fp_blocks:.1f}×)"
        in readme
    )
    assert f"{blocks / fp_blocks:.1f}× the blocks of fp16" in readme  # the serving table
    assert f"{ours:,} bytes per token on SmolLM2-135M against vLLM's {fp16:,} in fp16" in serving
    said = f"{blocks} blocks of {BLOCK} tokens against {fp_blocks} for its fp16 cache"
    assert re.search(re.escape(said) + rf" \({blocks / fp_blocks:.1f}x", serving)
