"""The bad-input corpus's fixtures (tests/support/corpus.py), made once per session."""

import pytest
from support.corpus import FULL_RECIPE, TEXT, Fixtures
from support.tiny import save_with_tokenizer, tiny_model

CONTEXT = 256  # the corpus model's max_position_embeddings


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Fixtures:
    """A tiny llama (context 256), calibrated on 2 windows of 32 tokens, and converted with
    corpus.FULL_RECIPE (static smoothed codebook keys, rotated codebook values)."""
    import kvcalib

    root = tmp_path_factory.mktemp("corpus")
    src = save_with_tokenizer(tiny_model("llama", max_position_embeddings=CONTEXT), root / "src")
    (root / "text.txt").write_text(TEXT)
    kvcalib.calibrate(
        str(src), root / "profile", data=root / "text.txt", num_samples=2, seq_len=32,
        progress=False,
    )  # fmt: skip
    (root / "full.toml").write_text(FULL_RECIPE)
    converted = kvcalib.convert(
        src, recipe=root / "full.toml", output=root / "converted", profile=root / "profile"
    )
    return Fixtures(src, root / "profile", converted)
