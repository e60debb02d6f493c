"""Makes the tiny converted folder of the plugin's Qwen2 test, with the toolkit (run by `make
test-vllm` in the toolkit's venv, the repository's tests/ on PYTHONPATH):

    python vllm_plugin/tests/make_tiny.py OUT_DIR  ->  OUT_DIR/tiny-qwen2-kvcalib-2/

A random 2-layer Qwen2 (hidden 128, 4 heads, 2 KV heads of 32 channels, q/k/v biases, one token
per character), calibrated on the corpus's text and converted with kvcalib-2 less its predicted
sinks (random weights have no massive activation to predict one from).
"""

import sys
from pathlib import Path

from corpus import TEXT
from tiny import save_with_tokenizer, tiny_model

import kvcalib

RECIPE = Path(__file__).parents[2] / "recipes" / "kvcalib-2.toml"


def main(out: Path) -> None:
    root = out / "tiny-qwen2-src"
    model = tiny_model("qwen2", hidden_size=128, max_position_embeddings=1024)
    src = save_with_tokenizer(model, root / "model")
    (root / "text.txt").write_text(TEXT * 4)
    recipe = RECIPE.read_text().replace('name = "kvcalib-2"', 'name = "kvcalib-2-first-sink"')
    recipe = recipe.replace("predicted = true\nbudget = 8", "predicted = false")
    assert "predicted = false" in recipe
    (root / "recipe.toml").write_text(recipe)
    kvcalib.calibrate(str(src), root / "profile", data=root / "text.txt", num_samples=4,
                      seq_len=64, progress=False, force=True)  # fmt: skip
    kvcalib.convert(src, recipe=root / "recipe.toml", output=out / "tiny-qwen2-kvcalib-2",
                    profile=root / "profile", force=True)  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
