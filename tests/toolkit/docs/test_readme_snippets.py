"""The README's Python snippets run as written, on the default model: each one is either run here
or skipped with the reason, and a new snippet that is neither fails."""

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
# The profile `make long-context` reads: the default calibration of SmolLM2-135M, committed.
PROFILE = ROOT / "benchmarks" / "long_context" / "smollm2-135m" / "profile"
SKIPPED = {
    "kvcalib.calibrate(": "the whole pipeline: its default calibration alone takes 390 s",
}
RUN = {"QuantizedKVCache.from_recipe(": "the transformers snippet"}


def snippets() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)


def test_every_snippet_is_run_or_skipped_with_its_reason():
    keys = [*SKIPPED, *RUN]
    assert len(snippets()) >= 2
    for code in snippets():
        assert sum(k in code for k in keys) == 1, f"neither run nor skipped here:\n{code}"


@pytest.mark.parametrize("key", SKIPPED)
def test_skipped_snippet(key):
    assert any(key in code for code in snippets())
    pytest.skip(SKIPPED[key])


@pytest.mark.slow  # loads SmolLM2-135M and generates 32 tokens through kvcalib-2: ~25 s
def test_transformers_snippet_generates_through_kvcalib2(tmp_path, monkeypatch):
    [code] = [c for c in snippets() if "QuantizedKVCache.from_recipe(" in c]
    assert '"profile/"' in code  # the folder `kvcalib calibrate -o profile/` wrote
    (tmp_path / "profile").symlink_to(PROFILE, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    text = out.getvalue()
    # 32 greedy tokens after the prompt: the prompt comes back, and well over a few words follow.
    assert text.startswith("def fib(n):") and len(text) > len("def fib(n):") + 40, text
