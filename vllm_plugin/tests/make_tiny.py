"""Makes the tiny converted folders of the plugin's Qwen2 tests, with the toolkit (run by `make
test-vllm` in the toolkit's venv, the repository's tests/ on PYTHONPATH):

    python vllm_plugin/tests/make_tiny.py OUT_DIR  ->  OUT_DIR/tiny-qwen2-kvcalib-2/
                                                       OUT_DIR/tiny-qwen2-kvcalib-1.5/

A random 2-layer Qwen2 (hidden 128, 4 heads, 2 KV heads of 32 channels, q/k/v biases, one token
per character), calibrated once on the corpus's text and converted with kvcalib-2 and with
kvcalib-1.5 (vector codes), each less its predicted sinks (random weights have no massive
activation to predict one from).
"""

import sys
from pathlib import Path

from corpus import TEXT
from tiny import save_with_tokenizer, tiny_model

import kvcalib

RECIPES = Path(__file__).parents[2] / "recipes"


def first_sink_only(name: str, folder: Path) -> Path:
    """recipes/{name}.toml without predicted sinks, written into folder."""
    recipe = (RECIPES / f"{name}.toml").read_text()
    recipe = recipe.replace(f'name = "{name}"', f'name = "{name}-first-sink"')
    recipe = recipe.replace("predicted = true\nbudget = 8", "predicted = false")
    assert "predicted = false" in recipe and f"{name}-first-sink" in recipe
    path = folder / f"{name}.toml"
    path.write_text(recipe)
    return path


def main(out: Path) -> None:
    root = out / "tiny-qwen2-src"
    model = tiny_model("qwen2", hidden_size=128, max_position_embeddings=1024)
    src = save_with_tokenizer(model, root / "model")
    (root / "text.txt").write_text(TEXT * 4)
    kvcalib.calibrate(str(src), root / "profile", data=root / "text.txt", num_samples=4,
                      seq_len=64, progress=False, force=True)  # fmt: skip
    for name in ("kvcalib-2", "kvcalib-1.5"):
        kvcalib.convert(src, recipe=first_sink_only(name, root), output=out / f"tiny-qwen2-{name}",
                        profile=root / "profile", force=True)  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
