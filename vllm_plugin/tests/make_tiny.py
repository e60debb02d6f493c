"""Makes the tiny converted folders of the plugin's Qwen2 tests, with the toolkit (run by `make
test-vllm` in the toolkit's venv, the repository's tests/ on PYTHONPATH):

    python vllm_plugin/tests/make_tiny.py OUT_DIR  ->  OUT_DIR/tiny-qwen2-kvcalib-2/
                                                       OUT_DIR/tiny-qwen2-kvcalib-1.5/
                                                       OUT_DIR/tiny-qwen2-kvcalib-2-codebook/
                                                       OUT_DIR/tiny-qwen2-kivi-2/

A random 2-layer Qwen2 (hidden 128, 4 heads, 2 KV heads of 32 channels, q/k/v biases, one token
per character), calibrated once on the corpus's text and converted with kvcalib-2, with
kvcalib-1.5 (vector codes) and with kvcalib-2's values symmetric with a calibrated codebook (the
value layout of kvcalib-3 and -4, and of kvcalib-2 until 2026-12-04), each less its predicted
sinks (random weights have no massive activation to predict one from); and with kivi-2, whose
per-channel keys the plugin refuses (its refusal tests).
"""

import sys
from pathlib import Path

from support.corpus import TEXT
from support.tiny import save_with_tokenizer, tiny_model

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


def codebook_values(path: Path) -> Path:
    """The kvcalib-2 recipe at `path` with its values symmetric per token with a calibrated
    codebook (one fp16 scale per vector), written beside it."""
    recipe = path.read_text()
    byte, codebook = 'metadata_code = "byte"', 'symmetric = true\ncodebook = "calibrated"'
    assert f'rotation = "hadamard"\n{byte}' in recipe
    recipe = recipe.replace(byte, codebook)
    recipe = recipe.replace('name = "kvcalib-2-', 'name = "kvcalib-2-codebook-')
    out = path.with_name("kvcalib-2-codebook.toml")
    out.write_text(recipe)
    return out


def main(out: Path) -> None:
    root = out / "tiny-qwen2-src"
    model = tiny_model("qwen2", hidden_size=128, max_position_embeddings=1024)
    src = save_with_tokenizer(model, root / "model")
    (root / "text.txt").write_text(TEXT * 4)
    kvcalib.calibrate(str(src), root / "profile", data=root / "text.txt", num_samples=4,
                      seq_len=64, progress=False, force=True)  # fmt: skip
    recipes = {name: first_sink_only(name, root) for name in ("kvcalib-2", "kvcalib-1.5")}
    recipes["kvcalib-2-codebook"] = codebook_values(recipes["kvcalib-2"])
    recipes["kivi-2"] = "kivi-2"
    for name, recipe in recipes.items():
        kvcalib.convert(src, recipe=recipe, output=out / f"tiny-qwen2-{name}",
                        profile=root / "profile", force=True)  # fmt: skip


if __name__ == "__main__":
    main(Path(sys.argv[1]))
